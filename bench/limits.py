"""What limits cost and buy: jobs limited per key beside the same jobs unlimited, a busy
key's backlog beside none, and fair waiting for resources beside unfair, in one run.

    python bench/limits.py [--database mariadb|sqlite|URL] [--quick] [--repeat 2] [--fair-seconds 30]

* drain: N no-op jobs over 1,000 keys with `concurrency=2` each, beside the same N jobs
  without a key, drained by 2 forked processes x 16 threads (`JobWorker(burst=True)`),
  alternating (ABBA), medians; goal: limited at least 70% of unlimited;
* head of line: 100 jobs (10 ms each) of 100 other keys, the time until all have run,
  alone and behind 1,000 jobs of one key with `concurrency=1` pushed first, 1 process x 8;
* fair waiting: 8 processes leasing 2 resources for `--fair-seconds` (hold 20 ms, then
  release and ask again), acquisitions per process and their spread (max / min), with
  and without `fair=True`.

The database is the bench's own: ``mysql://root@127.0.0.1:3306/bench_limits`` by default,
or ``--database sqlite``; its rows are deleted before each phase and at the end.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# The folder of this file holds queue.py, which on sys.path would shadow the standard
# library's `queue`. Keep the checkout only.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb", help="mariadb, sqlite, or a DATABASE_URL")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--repeat", type=int, default=2, help="runs per drain configuration (2)")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per drain run (20000)")
    parser.add_argument("--fair-seconds", type=float, default=30.0, help="seconds per fair-waiting run (30)")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("limits", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from leases import NoResourceAvailable, Pool  # noqa: E402
from leases.models import Resource, Waiter  # noqa: E402
from leases.tasks import push_many  # noqa: E402
from leases.tasks.models import Job, LimitKey  # noqa: E402
from leases.tasks.registry import handler  # noqa: E402
from leases.tasks.worker import JobWorker  # noqa: E402

QUEUE = "bench-limits"
CTX = multiprocessing.get_context("fork")


@handler("benchl.noop", queue=QUEUE)
def noop(payload: object) -> None:
    """A no-op job."""


@handler("benchl.nap", queue=QUEUE)
def nap(payload: object) -> None:
    """A job of 10 ms."""
    time.sleep(0.01)


def purge() -> None:
    Job.objects.filter(queue=QUEUE).delete()
    LimitKey.objects.all().delete()
    Resource.objects.filter(pool="bench-fair").delete()
    Waiter.objects.all().delete()


def drain_child(barrier, out) -> None:
    worker = JobWorker(queues=[QUEUE], concurrency=16, burst=True, poll=0.01)
    barrier.wait()
    began = time.monotonic()
    worker.run()
    out.put(time.monotonic() - began)
    connections.close_all()


def drain(jobs: int, limited: bool) -> float:
    """Jobs/s of 2 processes x 16 draining `jobs` no-op jobs, over 1,000 keys or none."""
    purge()
    push_many(("benchl.noop", {"n": n}, {"limit_key": f"k{n % 1000}", "concurrency": 2} if limited else {})
              for n in range(jobs))
    connections.close_all()
    barrier, out = CTX.Barrier(3), CTX.Queue()
    procs = [CTX.Process(target=drain_child, args=(barrier, out)) for _ in range(2)]
    for proc in procs:
        proc.start()
    barrier.wait()
    began = time.monotonic()
    for proc in procs:
        proc.join()
    wall = time.monotonic() - began
    left = Job.objects.filter(queue=QUEUE).exclude(status=Job.SUCCEEDED).count()
    if left:
        raise SystemExit(f"a drain left {left} jobs")
    return jobs / wall


def head_of_line(backlog: bool) -> float:
    """Seconds until 100 jobs of 100 keys have run, alone or behind a busy key's 1,000."""
    purge()
    if backlog:
        push_many(("benchl.nap", {"busy": n}, {"limit_key": "busy", "concurrency": 1}) for n in range(1000))
    push_many(("benchl.nap", {"site": n}, {"limit_key": f"site-{n}", "concurrency": 2}) for n in range(100))
    others = Job.objects.filter(queue=QUEUE, limit_key__startswith="site-")
    worker = JobWorker(queues=[QUEUE], concurrency=8, poll=0.01)
    began = time.monotonic()
    import threading

    thread = threading.Thread(target=worker.run)
    thread.start()
    while others.filter(status=Job.SUCCEEDED).count() < 100:
        time.sleep(0.02)
    took = time.monotonic() - began
    worker.stop()
    thread.join()
    return took


def fair_child(fair: bool, seconds: float, barrier, out) -> None:
    pool = Pool("bench-fair")
    barrier.wait()
    end, count = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            lease = pool.acquire(ttl=10, wait=max(0.1, end - time.monotonic()), fair=fair)
        except NoResourceAvailable:
            break
        time.sleep(0.02)
        lease.release()
        count += 1
    out.put(count)
    connections.close_all()


def fairness(fair: bool, seconds: float) -> list[int]:
    """Acquisitions per process of 8 on 2 resources."""
    purge()
    Pool("bench-fair").add_many([("a", None), ("b", None)])
    connections.close_all()
    barrier, out = CTX.Barrier(8), CTX.Queue()
    procs = [CTX.Process(target=fair_child, args=(fair, seconds, barrier, out)) for _ in range(8)]
    for proc in procs:
        proc.start()
    counts = sorted(out.get(timeout=seconds + 60) for _ in procs)
    for proc in procs:
        proc.join()
    return counts


def main() -> None:
    jobs, repeat, seconds = (2000, 1, 5.0) if ARGS.quick else (ARGS.jobs, ARGS.repeat, ARGS.fair_seconds)
    call_command("migrate", verbosity=0)
    version = database_version()
    load = os.getloadavg()[0]
    began = time.monotonic()
    print(f"{version}; {os.cpu_count()} cores; load average {load:.2f}", flush=True)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeat):
        for limited in (False, True) if i % 2 == 0 else (True, False):
            rates[limited].append(drain(jobs, limited))
            print(f"  drain {'limited' if limited else 'unlimited'}: {rates[limited][-1]:,.0f} jobs/s", flush=True)
    alone, behind = head_of_line(False), head_of_line(True)
    print(f"  head of line: {alone:.2f} s alone, {behind:.2f} s behind the busy key", flush=True)
    unfair, fair = fairness(False, seconds), fairness(True, seconds)
    purge()
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"\ndrain of {jobs:,} no-op jobs, 2 processes x 16, median of {repeat} (ABBA):")
    print(f"  unlimited {statistics.median(rates[False]):,.0f} jobs/s; over 1,000 keys with concurrency=2"
          f" {statistics.median(rates[True]):,.0f} jobs/s: {ratio:.0%} (goal: at least 70%)")
    print(f"head of line: 100 jobs of other keys ran in {alone:.2f} s alone and {behind:.2f} s behind"
          f" 1,000 jobs of one key with concurrency=1 ({behind / alone:.2f}x)")
    for label, counts in (("without fair", unfair), ("with fair=True", fair)):
        print(f"fair waiting, 8 processes on 2 resources for {seconds:g} s, {label}: {sum(counts):,} acquisitions,"
              f" per process {counts[0]} to {counts[-1]}, spread max/min {counts[-1] / max(counts[0], 1):.2f}")
    print(f"goal: limited drain at least 70% of unlimited: {ratio:.0%} {'met' if ratio >= 0.7 else 'MISSED'};"
          f" {time.monotonic() - began:.0f} s in all; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
