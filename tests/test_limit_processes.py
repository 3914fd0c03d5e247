"""Per-key limits across real `leases_worker` processes: concurrency never exceeded
(from the handlers' own start and end times), a rate held over any window, no head-of-line
blocking behind a busy key, and a SIGKILLed worker's slots back with its jobs."""
from __future__ import annotations

import os
import signal

import pytest

import tests.jobs  # noqa: F401 - registers "limited", "rated" and "noop"
from leases.tasks import push, push_many
from leases.tasks.models import Job
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
