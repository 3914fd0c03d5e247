"""A handler's limits apply to its jobs whoever enqueues them: a push, a pipeline's task
(a key computed from what the handler receives: its item and its run's context), a
schedule's tick, the Django Tasks backend. The jobs are made in one place, so the rows
carry the key and the limits, and a claim holds back what the key has no room for."""
from __future__ import annotations

from datetime import timedelta

import pytest

import tests.jobs  # noqa: F401 - registers the limit.* handlers
import tests.pipes as pipes
from leases.clock import db_now
from leases.tasks import handler, schedule
from leases.tasks.models import Job, Schedule
from leases.tasks.schedules import fire_due
from leases.tasks.worker import JobWorker, execute
from tests import tasks_demo

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def limits_of(name: str) -> set[tuple[str, int | None, str]]:
    return set(Job.objects.filter(name=name).values_list("limit_key", "concurrency", "rate"))




def worker() -> JobWorker:
    w = JobWorker(queues=["default"], concurrency=10, ttl=30)
    w.register()
    return w


def advance(w: JobWorker) -> list:
    """Run what the claims bring (the fans' lists, the advance events that queue their
    tasks); leave the limited tasks running, and return them."""
    held = []
    for _ in range(4):
        for job in w.claim(20):
            if job.name.startswith("limit."):
                held.append(job)
            else:
                w.finish([execute(job)])
    return held


def test_a_pipelines_tasks_carry_their_handlers_limits():
    pipes.limited_fan.start(context={"items": list(range(6))})
    pipes.rated_fan.start(context={"items": list(range(3))})
    held = advance(worker())
    assert Job.objects.filter(name="limit.one").count() == 6
    assert limits_of("limit.one") == {("one", 1, "")}
    assert limits_of("limit.rated") == {("rated", None, "2/s")}
    assert sorted(job.name for job in held) == ["limit.one", "limit.rated", "limit.rated"]
    assert Job.objects.filter(name="limit.one", status=Job.BLOCKED).count() == 5  # the key's one slot is taken
    assert Job.objects.get(name="limit.rated", status=Job.READY).run_at > db_now()  # the third waits its second


def test_a_limit_key_of_the_payload_is_computed_from_the_item_the_task_receives():
    sites = [{"site": site, "n": n} for n, site in enumerate("aabbbc")]
    pipes.sites_fan.start(context={"items": sites, "seconds": 0})
    advance(worker())
    keys = sorted(Job.objects.filter(name="limit.by_site").values_list("limit_key", flat=True))
    assert keys == ["a", "a", "b", "b", "b", "c"]
    assert limits_of("limit.by_site") == {("a", 1, ""), ("b", 1, ""), ("c", 1, "")}


def test_a_schedules_jobs_carry_their_handlers_limits():
    schedule("one", "limit.one", every=60, payload={"seconds": 0})
    schedule("rated", "limit.rated", every=60, catch_up=Schedule.ALL)
    Schedule.objects.update(next_fire_at=db_now() - timedelta(seconds=150))
    assert fire_due() == 1 + 3  # "rated" catches up on all three ticks
    assert limits_of("limit.one") == {("one", 1, "")}
    assert limits_of("limit.rated") == {("rated", None, "2/s")}


def test_a_django_tasks_jobs_carry_the_limits_set_above_it():
    tasks_demo.one_at_a_time.enqueue(log="/dev/null", seconds=0)
    tasks_demo.rated_per_site.enqueue(site="example.com", n=1)
    tasks_demo.add.enqueue(1, 2)
    assert limits_of("tests.tasks_demo.one_at_a_time") == {("one", 1, "")}
    assert limits_of("tests.tasks_demo.rated_per_site") == {("example.com", None, "2/s")}
    assert limits_of("tests.tasks_demo.add") == {("", None, "")}


def test_handler_above_a_django_task_takes_only_limits():
    with pytest.raises(ValueError, match="takes only limit_key, concurrency and rate"):
        handler(queue="other", concurrency=1)(tasks_demo.add)
    with pytest.raises(ValueError, match="needs a name"):
        handler(concurrency=1)(lambda payload: None)
