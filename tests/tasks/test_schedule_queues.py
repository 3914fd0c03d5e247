"""Which queue a schedule's jobs go on, and one waiting job at most with catch_up none, in
one process with a controlled clock (`fire_due(now=...)`).

A pipeline's scheduled start used to go on "default" (the start handler's queue) whatever
queue the pipeline's work used, and `schedule show` said "(the handler's)"; with workers
only on "crawl", each tick left a start waiting, and when a "default" worker came they
all started at once, catch_up none or not. Processes: test_scheduled_pipelines."""
from __future__ import annotations

import io
import logging
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command

import tests.jobs  # noqa: F401 - registers noop
import tests.schedule_pipes  # noqa: F401 - crawl-fleet, its tasks on queue crawl
from leases.tasks import schedule
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules import fire, fire_due
from leases.tasks.schedules.serving import place
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

START = "leases.pipelines.start"
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def nothing_said():
    """What the leader said once per schedule is this process's: each test starts anew."""
    fire._said.clear()
    yield
    fire._said.clear()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def every_second(name: str, **options) -> Schedule:
    row = schedule(name, every=1, **options)
    Schedule.objects.filter(pk=row.pk).update(next_fire_at=T0)
    return Schedule.objects.get(pk=row.pk)


def show(name: str) -> dict[str, str]:
    out = io.StringIO()
    call_command("schedule", "show", name, stdout=out)
    head = out.getvalue().split("\n\n")[0]
    return {line[:10].strip(): line[10:].strip() for line in head.splitlines()}


def starts(name: str) -> list[Job]:
    return list(Job.objects.filter(key__startswith=f"schedule:{name}:").order_by("pk"))


def test_a_scheduled_pipeline_starts_on_the_queue_of_its_first_tasks():
    every_second("fleet", pipeline="crawl-fleet", catch_up="none")
    assert fire_due(now=at(0)) == 1
    [job] = starts("fleet")
    assert (job.name, job.queue) == (START, "crawl")  # not "default": no worker there needed
    lines = show("fleet")
    assert lines["queue"] == "crawl (its pipeline's first tasks')"
    assert lines["served by"] == "WARNING: no live worker serves queue crawl: its jobs wait until one does" \
                                 " (leases_worker --queue crawl)"
    crawler = JobWorker(queues=["crawl"], burst=True, poll=0.01)
    crawler.register()
    assert show("fleet")["served by"] == f"1 live worker(s): {crawler.name}"
    crawler.run()  # starts the run, then does its work: all on crawl
    assert ScheduleRun.objects.get().status == "succeeded"
    assert not Job.objects.exclude(queue="crawl").exists()


def test_a_schedules_own_queue_and_a_handlers_queue_are_shown_as_such():
    schedule("own", pipeline="crawl-fleet", every=60, queue="other")
    schedule("handler", "noop", every=60)
    assert show("own")["queue"] == "other (the schedule's own)"
    assert show("handler")["queue"] == "default (its handler's)"
    Schedule.objects.filter(name="own").update(next_fire_at=T0)
    fire_due(now=at(0))
    assert [job.queue for job in starts("own")] == ["other"]


def test_catch_up_none_keeps_one_job_waiting_and_fires_again_once_it_is_claimed(caplog):
    caplog.set_level(logging.WARNING, logger="leases.tasks.scheduler")
    every_second("fleet", pipeline="crawl-fleet", catch_up="none")
    every_second("ping", handler="noop", catch_up="none")
    every_second("piling", handler="noop")  # catch_up "last": a job per tick, as before
    assert fire_due(now=at(0)) == 3
    for second in range(1, 6):  # nobody claims: each tick finds the last job waiting
        assert fire_due(now=at(second)) == 1  # "piling" only
    assert (len(starts("fleet")), len(starts("ping")), len(starts("piling"))) == (1, 1, 6)
    rows = {row.name: row for row in Schedule.objects.all()}
    assert rows["fleet"].fires == 1 and rows["fleet"].next_fire_at == at(6)  # moved on past skipped ticks
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2  # once per waiting job, not per tick
    assert skipped[0].startswith("schedule fleet: tick 2030-01-01 00:00:01Z skipped, and its next ones until job"
                                 f" #{starts('fleet')[0].pk} of its last run is claimed")
    # Claimed (running, or ended): the next tick fires again.
    Job.objects.filter(pk=starts("fleet")[0].pk).update(status=Job.RUNNING, claims=1, attempt=1)
    Job.objects.filter(pk=starts("ping")[0].pk).update(status=Job.SUCCEEDED, claims=1, attempt=1)
    assert fire_due(now=at(6)) == 3
    assert (len(starts("fleet")), len(starts("ping"))) == (2, 2)


def test_a_job_retried_or_deleted_does_not_hold_the_next_tick_back():
    every_second("ping", handler="noop", catch_up="none")
    fire_due(now=at(0))
    Job.objects.filter(key__startswith="schedule:ping:").update(claims=1, attempt=1)  # awaits a retry: claimed once
    assert fire_due(now=at(1)) == 1
    Job.objects.filter(key__startswith="schedule:ping:").delete()
    assert fire_due(now=at(2)) == 1


def test_a_pipeline_this_process_does_not_know_goes_on_default_and_the_leader_says_so_once(caplog):
    caplog.set_level(logging.WARNING, logger="leases.tasks.scheduler")
    every_second("gone", pipeline="crawl-fleet", catch_up="last")
    Schedule.objects.filter(name="gone").update(pipeline="defined-elsewhere")  # as a worker without its module
    assert place(Schedule.objects.get(name="gone"), "default").known is False
    fire_due(now=at(0))
    fire_due(now=at(1))
    assert [job.queue for job in starts("gone")] == ["default", "default"]
    said = [r.getMessage() for r in caplog.records if "defined-elsewhere" in r.getMessage()]
    assert said == ["schedule gone: its jobs go on queue 'default': pipeline 'defined-elsewhere' or its first task"
                    " is not defined in this process (define it in an installed app, or --import its module in"
                    " every worker that may lead)"]


def test_a_pipeline_whose_first_tasks_queue_is_routed_elsewhere_is_refused(settings):
    settings.LEASES_ROUTES = {"queues": {"crawl": "second"}}
    with pytest.raises(ValueError, match="schedule: queue 'crawl' is routed to database 'second'"):
        schedule("fleet", pipeline="crawl-fleet", every=60)
    assert schedule("fleet", pipeline="crawl-fleet", every=60, queue="default").queue == "default"
