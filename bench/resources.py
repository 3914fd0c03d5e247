"""Jobs that hold resources, beside the two ways to get the same without them, in one run.

    python bench/resources.py [--database mariadb|postgres|sqlite|URL] [--quick] [--jobs 2000]

Each way drains the same work with 2 forked worker processes x 32 threads
(`JobWorker(burst=True)`): N crawl jobs that each need one of 40 resources for 10 ms,
mixed with N no-op plain jobs pushed with them:

* claimed with their lease (`@handler(lease="bench")`): the queue starts a crawl job only
  with a lease on a free resource;
* the lease taken inside the handler, as a user writes it without the feature
  (`with Pool("bench").lease(ttl=30, wait=120)`): a thread waits for a resource;
* a per-key limit of 40 (`limit_key="bench", concurrency=40`): no resource at all, the
  ceiling of "at most 40 at once" in this queue (goal: the lease-claimed drain at least
  0.8 of its rate).

Reported: crawl jobs/s, plain jobs/s (each from its first push to its last end), and the
share of the worker threads' time spent waiting for a resource inside a handler.
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
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb", help="mariadb, postgres, sqlite, or a DATABASE_URL")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--jobs", type=int, default=2000, help="crawl jobs (and as many plain ones) per run (2000)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way, alternating (2)")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("resources", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from leases import Pool  # noqa: E402
from leases.models import Resource, ResourceTarget  # noqa: E402
from leases.tasks import push_many  # noqa: E402
from leases.tasks.models import Affinity, Job, LimitKey, PoolTurn  # noqa: E402
from leases.tasks.registry import handler  # noqa: E402
from leases.tasks.worker import JobWorker  # noqa: E402

POOL, RESOURCES, SECONDS, PROCS, THREADS = "bench", 40, 0.010, 2, 32
WAITED = multiprocessing.get_context("fork").Value("d", 0.0)


@handler("bench.claimed", queue="bench", lease=POOL, max_attempts=3, backoff=0.0)
def claimed(payload):
    time.sleep(SECONDS)


@handler("bench.inside", queue="bench", max_attempts=3, backoff=0.0)
def inside(payload):
    began = time.monotonic()
    with Pool(POOL).lease(ttl=30, wait=120):
        waited = time.monotonic() - began
        time.sleep(SECONDS)
    with WAITED.get_lock():
        WAITED.value += waited


@handler("bench.limited", queue="bench", limit_key="bench", concurrency=RESOURCES, max_attempts=3, backoff=0.0)
def limited(payload):
    time.sleep(SECONDS)


@handler("bench.plain", queue="bench", max_attempts=3, backoff=0.0)
def plain(payload):
    return None


WAYS = {"claimed with its lease": "bench.claimed", "lease inside the handler": "bench.inside",
        "per-key limit of 40 (no resource)": "bench.limited"}


def clean() -> None:
    for model in (Job, LimitKey, PoolTurn, Affinity, ResourceTarget):
        model.objects.all().delete()
    Resource.objects.filter(pool=POOL).update(busy_before="2000-01-01T00:00:00Z", holder="")


def _child(barrier: object) -> None:
    worker = JobWorker(queues=["bench"], concurrency=THREADS, burst=True, poll=0.01)
    worker.register()
    barrier.wait(timeout=60)
    worker.run()


def drain(name: str, jobs: int) -> dict:
    clean()
    with WAITED.get_lock():
        WAITED.value = 0.0
    items = []
    for n in range(jobs):  # mixed: a crawl job, then a plain one
        items += [(name, {"n": n}), ("bench.plain", {"n": n})]
    push_many(items)
    connections.close_all()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(PROCS + 1)
    children = [ctx.Process(target=_child, args=(barrier,)) for _ in range(PROCS)]
    for child in children:
        child.start()
    barrier.wait(timeout=60)
    began = time.monotonic()
    for child in children:
        child.join()
    wall = time.monotonic() - began
    rates = {}
    for kind, job_name in (("crawl", name), ("plain", "bench.plain")):
        done = Job.objects.filter(name=job_name, status=Job.SUCCEEDED)
        first = min(done.values_list("started_at", flat=True))
        last = max(done.values_list("finished_at", flat=True))
        rates[kind] = done.count() / max((last - first).total_seconds(), 1e-6)
    return {**rates, "wall": wall, "waiting": WAITED.value / (wall * PROCS * THREADS)}


def main() -> None:
    args = ARGS
    import logging

    logging.getLogger("leases").setLevel(logging.ERROR)
    jobs = 300 if args.quick else args.jobs
    call_command("migrate", verbosity=0, interactive=False)
    Pool(POOL).add_many([(f"r{n:02d}", None) for n in range(RESOURCES)])
    print(f"{database_version()}; {os.cpu_count()} cores; {jobs:,} crawl jobs of {SECONDS * 1000:g} ms over"
          f" {RESOURCES} resources and {jobs:,} plain no-op jobs, {PROCS} processes x {THREADS} threads", flush=True)
    found: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way, name in WAYS.items():
            found[way].append(drain(name, jobs))
    print(f"\n{'':36} {'crawl jobs/s':>12} {'plain jobs/s':>12} {'threads waiting':>16}")
    for way, runs in found.items():
        crawl = statistics.median(run["crawl"] for run in runs)
        plain_rate = statistics.median(run["plain"] for run in runs)
        waiting = statistics.median(run["waiting"] for run in runs)
        print(f"{way:36} {crawl:>12,.0f} {plain_rate:>12,.0f} {waiting:>15.0%}")
    mine = statistics.median(run["crawl"] for run in found["claimed with its lease"])
    ceiling = statistics.median(run["crawl"] for run in found["per-key limit of 40 (no resource)"])
    ideal = RESOURCES / SECONDS
    print(f"\nclaimed with its lease: {mine / ceiling:.2f} of the per-key limit's rate (goal 0.8);"
          f" the resources' ceiling is {ideal:,.0f} jobs/s (40 at a time, {SECONDS * 1000:g} ms each)")
    clean()
    Resource.objects.filter(pool=POOL).delete()


if __name__ == "__main__":
    main()
