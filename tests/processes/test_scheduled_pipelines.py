"""Scheduled pipelines and the scheduler's lead with real `leases_worker` processes at
their defaults: workers only on `--queue crawl` (as docs/resources.md has a crawl fleet)
start the runs of a pipeline scheduled every two seconds, with no worker on "default";
ticks fired while no worker serves the pipeline's queue leave one start waiting, not one
per tick, so one run starts when a worker comes (catch_up none); a worker of another
queue leads (a tick only writes rows), a `--burst` one does not."""
from __future__ import annotations

import signal

import pytest

import tests.jobs  # noqa: F401 - registers noop and sleepy, which the test pushes
import tests.schedule_pipes  # noqa: F401 - crawl-fleet, which the test schedules
from leases.clock import db_now
from leases.pipelines.models import Run
from leases.tasks import push, schedule
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules import set_enabled
from tests.conftest import wait_for
from tests.processes.test_schedule_processes import leader

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

CRAWL = ("--import", "tests.schedule_pipes", "--queue", "crawl")
START = "leases.pipelines.start"


def stop(workers, procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc) == 0, workers.stderr(proc)


def succeeded() -> int:
    return Run.objects.filter(status=Run.SUCCEEDED).count()


def test_workers_only_on_crawl_start_a_pipeline_scheduled_every_two_seconds(workers, tmp_path):
    procs = [workers.start(*CRAWL) for _ in range(2)]
    wait_for(leader, 30, "a worker to lead the scheduler")
    schedule("fleet", pipeline="crawl-fleet", every=2, catch_up="none", context={"log": str(tmp_path / "tasks")})
    wait_for(lambda: succeeded() >= 3, 60, "three scheduled runs to succeed")
    set_enabled("fleet", False)
    wait_for(lambda: not Job.objects.exclude(status=Job.SUCCEEDED).exists(), 30, "the runs in flight to end")
    stop(workers, procs)
    fired = list(ScheduleRun.objects.filter(schedule__name="fleet"))
    assert {run.status for run in fired} == {"succeeded"} and Run.objects.count() == len(fired) >= 3
    assert set(Job.objects.values_list("queue", flat=True)) == {"crawl"}  # the starts too: nothing on default
    assert Job.objects.filter(name=START).count() == len(fired)


def test_ticks_fired_while_no_worker_serves_the_queue_start_one_run_when_a_worker_comes(workers, tmp_path):
    # Leads (a tick only writes rows) and knows the pipeline, but serves no crawl.
    review = workers.start("--import", "tests.schedule_pipes", "--queue", "other")
    wait_for(leader, 30, "a worker to lead the scheduler")
    schedule("fleet", pipeline="crawl-fleet", every=1, catch_up="none", context={"log": str(tmp_path / "tasks")})
    first = wait_for(lambda: Job.objects.filter(name=START).first(), 30, "the first tick's start")
    wait_for(lambda: "schedule fleet: tick" in workers.stderr(review), 30, "a tick skipped")
    later = db_now()
    wait_for(lambda: Schedule.objects.get(name="fleet").next_fire_at.timestamp() > later.timestamp() + 4, 30,
             "four more ticks to pass")
    assert [job.pk for job in Job.objects.filter(name=START)] == [first.pk]  # one start waits, not one per tick
    assert ScheduleRun.objects.count() == 1
    came = db_now()
    crawler = workers.start(*CRAWL)
    wait_for(lambda: succeeded() >= 3, 60, "three runs to succeed")
    set_enabled("fleet", False)
    wait_for(lambda: not Job.objects.exclude(status=Job.SUCCEEDED).exists(), 30, "the runs in flight to end")
    stop(workers, [review, crawler])
    # The waiting start began the first run; every other run is of a tick after the crawler came.
    assert ScheduleRun.objects.filter(fired_at__lt=came).count() == 1
    assert Run.objects.count() == ScheduleRun.objects.count()
    assert "leads" in workers.stderr(review) and "leads" not in workers.stderr(crawler)
    assert "its jobs go on queue 'default'" not in workers.stderr(review)  # it knew where they go


def test_a_burst_worker_does_not_lead(workers):
    push("sleepy", {"seconds": 3})
    schedule("ping", "noop", every=1)
    burst = workers.start("--burst", "--queue", "default")
    assert workers.wait(burst) == 0
    log = workers.stderr(burst)
    assert "stopped: 1 claimed: 1 succeeded" in log and "leads" not in log, log
    assert not ScheduleRun.objects.exists() and leader() is None
