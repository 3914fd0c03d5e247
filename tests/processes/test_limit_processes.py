"""Per-key limits across real `leases_worker` processes: concurrency never exceeded
(from the handlers' own start and end times), a rate held over any window, no head-of-line
blocking behind a busy key, and a SIGKILLed worker's slots back with its jobs; and a
handler's limits hold whoever enqueued its jobs: a pipeline, a schedule, Django Tasks."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
from django.db import connection

import tests.jobs  # noqa: F401 - registers "limited", "rated", "noop" and the limit.* handlers
import tests.pipes as pipes
from leases.clock import db_now
from leases.pipelines.models import Run
from leases.tasks import push, push_many, schedule
from leases.tasks.models import Job, Schedule
from leases.tasks.schedules import set_enabled
from tests import tasks_demo
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]


def windows(path) -> dict[str, list[tuple[float, float]]]:
    """key -> [(start, end)] of each run, as the handlers logged them."""
    found: dict[str, list[tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        key, began, ended, _pid = line.split()
        found.setdefault(key, []).append((float(began), float(ended)))
    return found


def peak(runs: list[tuple[float, float]]) -> int:
    events = sorted([(began, 1) for began, _ in runs] + [(ended, -1) for _, ended in runs])
    holders = most = 0
    for _, step in events:
        holders += step
        most = max(most, holders)
    return most


def done(count: int) -> bool:
    return Job.objects.filter(status=Job.SUCCEEDED).count() >= count


def test_a_key_never_runs_more_than_its_concurrency_across_three_workers(workers, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("limited", {"key": key, "n": n, "seconds": 0.1, "log": str(log)}) for key in "ab" for n in range(24)])
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--burst") for _ in range(3)]
    for proc in procs:
        assert workers.wait(proc, 120) == 0, workers.stderr(proc)
    runs = windows(log)
    assert {key: len(found) for key, found in runs.items()} == {"a": 24, "b": 24}
    assert {key: peak(found) for key, found in runs.items()} == {"a": 2, "b": 2}  # reached, never passed
    assert set(Job.objects.values_list("status", "attempt")) == {(Job.SUCCEEDED, 1)}  # waiting used no try


def test_a_rate_holds_over_any_window(workers, tmp_path):
    push_many([("rated", {"key": "r", "n": n, "seconds": 0.01}) for n in range(15)])
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--burst") for _ in range(2)]
    for proc in procs:
        assert workers.wait(proc, 120) == 0, workers.stderr(proc)
    starts = sorted(Job.objects.values_list("started_at", flat=True))
    assert len(starts) == 15 and set(Job.objects.values_list("attempt", flat=True)) == {1}
    for first, sixth in zip(starts, starts[5:]):  # five starts a second: the sixth is a second later
        assert (sixth - first).total_seconds() >= 0.999, (first, sixth)


def test_a_busy_key_does_not_hold_up_the_other_keys(workers, tmp_path):
    busy = [("limited", {"key": "busy", "n": n, "seconds": 0.05}, {"concurrency": 1}) for n in range(1000)]
    push_many(busy)  # first in line, same priority
    others = [push("limited", {"key": f"site-{n}", "n": n, "seconds": 0.05}).pk for n in range(100)]
    proc = workers.start("--queue", "default", "--concurrency", "8")
    wait_for(lambda: Job.objects.filter(pk__in=others, status=Job.SUCCEEDED).count() == 100, 60,
             "the other keys' 100 jobs")
    behind = Job.objects.filter(limit_key="busy", status=Job.SUCCEEDED).count()
    assert behind < 200, behind  # one at a time: the others did not wait for them
    assert Job.objects.filter(limit_key="busy", status=Job.RUNNING).count() <= 1
    proc.send_signal(signal.SIGTERM)
    assert workers.wait(proc) == 0


def test_a_killed_workers_slots_come_back_with_its_jobs(workers, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("limited", {"key": "k", "n": n, "seconds": 2, "log": str(log)}) for n in range(5)])
    doomed = workers.start("--queue", "default", "--concurrency", "4", "--ttl", "1.5")
    wait_for(lambda: Job.objects.filter(status=Job.RUNNING).count() == 2, 30, "two of the key running")
    assert Job.objects.filter(status=Job.BLOCKED).count() == 3
    os.kill(doomed.pid, signal.SIGKILL)
    rescuer = workers.start("--queue", "default", "--concurrency", "4", "--ttl", "1.5")
    wait_for(lambda: done(5), 60, "the key's five jobs, after the recovery")
    rescuer.send_signal(signal.SIGTERM)
    assert workers.wait(rescuer) == 0, workers.stderr(rescuer)
    runs = windows(log)["k"]
    assert len(runs) == 5 and peak(runs) <= 2  # the killed attempts logged nothing
    # The two killed attempts counted; the three that waited blocked used no try.
    assert sorted(Job.objects.values_list("attempt", flat=True)) == [1, 1, 1, 2, 2]


def drained(workers, procs) -> None:
    for proc in procs:
        assert workers.wait(proc, 120) == 0, workers.stderr(proc)


def stopped(workers, procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    drained(workers, procs)


def spaced(name: str, count: int, per_second: int) -> None:
    """`count` jobs of `name` started, no more than `per_second` in any second."""
    starts = sorted(Job.objects.filter(name=name).values_list("started_at", flat=True))
    assert len(starts) == count, starts
    for first, later in zip(starts, starts[per_second:]):
        assert (later - first).total_seconds() >= 0.999, (first, later)


def test_a_pipelines_for_each_runs_its_handler_one_at_a_time(workers, tmp_path):
    log = tmp_path / "runs.log"
    run = pipes.limited_fan.start(context={"items": list(range(6)), "log": str(log), "seconds": 0.5})
    procs = [workers.start("--queue", "default", "--concurrency", "6") for _ in range(2)]
    wait_for(lambda: Run.objects.get(pk=run.pk).status == Run.SUCCEEDED, 120, "the fan's run")
    stopped(workers, procs)
    runs = windows(log)["one"]
    assert len(runs) == 6 and peak(runs) == 1  # max_parallel 6, but the handler's key allows one


def test_a_schedules_jobs_run_their_handler_one_at_a_time(workers, tmp_path):
    log = tmp_path / "runs.log"
    procs = [workers.start("--queue", "default", "--concurrency", "2", "--ttl", "2") for _ in range(2)]
    schedule("one-every-second", "limit.one", every=1, payload={"log": str(log), "seconds": 1.5})
    time.sleep(7)
    set_enabled("one-every-second", False)
    wait_for(lambda: not Job.objects.filter(name="limit.one", status__in=["ready", "running", "blocked"]).exists(),
             60, "the scheduled jobs")
    stopped(workers, procs)
    runs = windows(log)["one"]
    assert len(runs) >= 4 and peak(runs) == 1  # a tick a second, 1.5 s each: one at a time all the same


def test_a_django_tasks_jobs_run_one_at_a_time(workers, tmp_path):
    log = tmp_path / "runs.log"
    for _ in range(4):
        tasks_demo.one_at_a_time.enqueue(log=str(log), seconds=0.4)
    drained(workers, [workers.start("--queue", "default", "--concurrency", "4", "--burst", "--import",
                                    "tests.tasks_demo") for _ in range(2)])
    runs = windows(log)["one"]
    assert len(runs) == 4 and peak(runs) == 1


def test_a_handlers_rate_holds_for_pipelines_schedules_and_django_tasks(workers, tmp_path):
    pipes.rated_fan.start(context={"items": list(range(5))})
    schedule("rated", "limit.rated", every=60, catch_up=Schedule.ALL)
    Schedule.objects.filter(name="rated").update(next_fire_at=db_now() - timedelta(seconds=270))  # 5 ticks due
    for n in range(5):
        tasks_demo.rated_per_site.enqueue(site="example.com", n=n)
    procs = [workers.start("--queue", "default", "--concurrency", "8", "--import", "tests.tasks_demo")
             for _ in range(2)]
    wait_for(lambda: Job.objects.filter(name__in=["limit.rated", "tests.tasks_demo.rated_per_site"],
                                        status=Job.SUCCEEDED).count() == 15, 90, "the rated jobs")
    stopped(workers, procs)
    spaced("limit.rated", 10, 2)  # the fan's five and the schedule's five share the key "rated"
    spaced("tests.tasks_demo.rated_per_site", 5, 2)


def test_claims_of_one_key_take_its_row_before_its_jobs_and_never_deadlock(workers, tmp_path):
    """Two idle workers, then six jobs of one key (two at a time) pushed at once: each
    claim locked the rows it picked, then the key's row, then blocked the key's other jobs,
    some held by the other claim, which waited for the key: a deadlock, found by PostgreSQL
    after its deadlock_timeout (the first job started a second late) and retried. A new key
    (its row inserted by the claim) and a known one, four times each."""
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--poll", "0.02") for _ in range(2)]
    wait_for(lambda: all("started" in workers.stderr(proc) for proc in procs), 30, "the workers to start")
    time.sleep(1.5)  # idle, past their first polls (and listening, on PostgreSQL)
    firsts = []
    for round_ in range(8):
        key = f"k{round_ % 4}"
        push_many([("limited", {"key": key, "n": n, "seconds": 0.05}) for n in range(6)])
        wait_for(lambda: Job.objects.filter(limit_key=key, status=Job.SUCCEEDED).count() == 6, 30, f"key {key}")
        jobs = Job.objects.filter(limit_key=key, status=Job.SUCCEEDED).order_by("-enqueued_at")[:6]
        firsts.append(min((job.started_at - job.enqueued_at).total_seconds() for job in jobs))
    stopped(workers, procs)
    logs = "".join(workers.stderr(proc) for proc in procs)
    assert "deadlock" not in logs, logs
    assert max(firsts) < (0.1 if connection.vendor == "postgresql" else 0.3), firsts
