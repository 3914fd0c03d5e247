"""Jobs that hold resources, run by real `leases_worker` processes: no resource serves two
jobs at overlapping times and its tokens only grow, every job runs; a target's ban keeps
that resource from that target only; a pace spaces a resource's starts per target; jobs
waiting for a resource hold no worker thread; and targets take turns when resources are
scarce. The handlers log each run from their own process (tests/jobs_leased.py)."""
from __future__ import annotations

import signal
import time
from collections import defaultdict

import pytest

import tests.jobs_leased  # noqa: F401 - registers leased.fetch, leased.paced, leased.plain here (the pusher)
from leases import Pool
from leases.tasks import push_many
from leases.tasks.models import Job
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

LEASED = ("--import", "tests.jobs_leased")


def runs(path) -> list[dict]:
    found = []
    for line in path.read_text().splitlines():
        if line.startswith("plain "):
            continue
        name, token, began, ended, target, pid, n = line.split()
        found.append({"name": name, "token": int(token), "began": float(began), "ended": float(ended),
                      "target": target, "pid": int(pid), "n": int(n)})
    return found


def no_overlap_and_growing_tokens(found: list[dict]) -> None:
    by_resource = defaultdict(list)
    for run in found:
        by_resource[run["name"]].append(run)
    for name, its in by_resource.items():
        its.sort(key=lambda run: run["began"])
        for before, after in zip(its, its[1:]):
            assert before["ended"] <= after["began"], (name, before, after)  # one job at a time
            assert before["token"] < after["token"], (name, before, after)  # fencing tokens only grow


def stop(workers, procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc, 60) == 0, workers.stderr(proc)


def test_three_workers_share_forty_resources_over_five_targets_and_a_ban_holds_per_target(workers, tmp_path):
    log = tmp_path / "runs.log"
    Pool("crawlpool").add_many([(f"r{n:02d}", None) for n in range(40)])
    push_many([("leased.fetch", {"n": n, "site": f"site-{n % 5}", "seconds": 0.002, "log": str(log),
                                 **({"ban_on": "r07"} if n % 5 == 0 else {})}) for n in range(5000)])
    procs = [workers.start("--concurrency", "8", *LEASED) for _ in range(3)]
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 5000, 180, "5,000 jobs")
    stop(workers, procs)
    found = runs(log)
    assert sorted(run["n"] for run in found) == list(range(5000))  # every job ran once to its end
    no_overlap_and_growing_tokens(found)
    assert not [run for run in found if run["target"] == "site-0" and run["name"] == "r07"]  # banned there
    assert [run for run in found if run["target"] != "site-0" and run["name"] == "r07"]  # used by the others
    assert set(Job.objects.values_list("attempt", flat=True)) == {1}  # the ban spent no attempt


def test_a_pace_spaces_each_resources_starts_per_target(workers, tmp_path):
    log = tmp_path / "runs.log"
    Pool("crawlpool").add_many([(f"r{n}", None) for n in range(3)])
    push_many([("leased.paced", {"n": n, "site": f"site-{n % 2}", "log": str(log)}) for n in range(30)])
    procs = [workers.start("--concurrency", "4", "--poll", "0.02", *LEASED) for _ in range(2)]
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 30, 60, "30 paced jobs")
    stop(workers, procs)
    starts = defaultdict(list)
    for run in runs(log):
        starts[(run["name"], run["target"])].append(run["began"])
    for pair, moments in starts.items():
        moments.sort()
        # The pace is kept by the database's clock at the claim; these moments are each
        # handler's start, later by a thread's wake-up (CI's busy cores: one gap of 0.289 s).
        assert all(later - earlier >= 0.25 for earlier, later in zip(moments, moments[1:])), (pair, moments)


def test_jobs_waiting_for_a_resource_hold_no_thread(workers, tmp_path):
    """Two resources, 400 jobs that need them (20 ms each) and 1,000 plain jobs, one worker
    of 16 threads: the plain jobs run at once beside the two resource jobs at a time, as if
    the others were not there; had each waiting job held a thread, they would wait."""
    log = tmp_path / "runs.log"
    Pool("crawlpool").add_many([("r0", None), ("r1", None)])
    push_many([("leased.fetch", {"n": n, "site": "a", "seconds": 0.02, "log": str(log)}) for n in range(400)])
    push_many([("leased.plain", {"n": n, "log": str(log)}) for n in range(1000)])
    began = time.monotonic()
    proc = workers.start("--concurrency", "16", "--poll", "0.02", *LEASED)
    wait_for(lambda: Job.objects.filter(name="leased.plain", status=Job.SUCCEEDED).count() == 1000, 60, "plain jobs")
    plain_done = time.monotonic() - began
    resource_done = Job.objects.filter(name="leased.fetch", status=Job.SUCCEEDED).count()
    assert resource_done < 400 and plain_done < 8, (plain_done, resource_done)  # 400 x 20 ms / 2 = 4 s at least
    assert Job.objects.filter(name="leased.fetch", status=Job.RUNNING).count() <= 2
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 1400, 60, "every job")
    stop(workers, [proc])
    no_overlap_and_growing_tokens(runs(log))


def test_when_resources_are_scarce_a_small_target_does_not_wait_for_a_big_ones_backlog(workers, tmp_path):
    log = tmp_path / "runs.log"
    Pool("crawlpool").add_many([(f"r{n}", None) for n in range(4)])
    push_many([("leased.fetch", {"n": n, "site": "big", "seconds": 0.05, "log": str(log)}) for n in range(1000)])
    push_many([("leased.fetch", {"n": 5000 + n, "site": "small", "seconds": 0.05, "log": str(log)}) for n in range(10)])
    proc = workers.start("--concurrency", "8", "--poll", "0.02", *LEASED)
    wait_for(lambda: Job.objects.filter(target="small", status=Job.SUCCEEDED).count() == 10, 60, "the small target")
    before = Job.objects.filter(target="big", status=Job.SUCCEEDED).count()
    stop(workers, [proc])
    assert before < 60, before  # turns: a few of big's jobs per small one, not big's backlog first
    found = sorted(runs(log), key=lambda run: run["began"])
    first_small = next(index for index, run in enumerate(found) if run["target"] == "small")
    assert first_small < 12, first_small
