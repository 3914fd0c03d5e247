"""The job queue beside Procrastinate on one PostgreSQL server, in one run.

    python bench/peers.py [--quick] [--jobs 20000] [--concurrency 4,16,32] [--pickup-jobs 200]

Both sides do the same work on databases of their own on the same server: ours in
``bench_peers`` (migrated; its table emptied and vacuumed before each measurement),
Procrastinate's in ``bench_procrastinate`` (its schema made anew for each measurement).
Both are measured as a running server keeps them: no dead rows, and statistics current,
each side's job table ANALYZEd after its jobs are pushed and before its workers start
(autovacuum would do it within a minute; without it, a planner that takes a 20,000-job
table for empty reads every waiting job at each fetch: Procrastinate drained 229 jobs/s
so, 874 to 969 with its statistics current).
Procrastinate runs from its own environment, ``bench/.peers/procrastinate``, made on first
use from requirements-procrastinate.txt; bench/peer_procrastinate.py is its side.

* enqueue: one job per call (``push`` / ``defer``), then 1000 per call (``push_many`` /
  ``batch_defer``), one process;
* drain: N no-op jobs preloaded (N/10, then N), then 2 worker processes until the queue
  is empty (ours: ``JobWorker(burst=True)``; theirs: ``run_worker(wait=False)`` with an
  async no-op task), at each concurrency; jobs/s = N / wall time, and the best
  concurrency of each at N counts;
* pickup: one idle worker, jobs pushed one at a time 10 to 50 ms apart; latency is the
  push's time to the claim's, both stamped by the server's clock. Ours listening (the
  default on PostgreSQL), ours polling every 50 ms (``listen=False``), theirs listening.

Runs alternate ours and theirs so a drift in the machine's load favours neither.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, peer_python, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

SERVER = "postgres://postgres@127.0.0.1:5432"
QUEUE, NAME = "bench_peers", "bench_peers_noop"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=SERVER, help=f"the PostgreSQL server, as a URL without database ({SERVER})")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (small counts)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per drain run, after runs of a tenth (20000)")
    parser.add_argument("--concurrency", default="4,16,32", help="worker concurrencies to try (4,16,32)")
    parser.add_argument("--pickup-jobs", type=int, default=None, help="jobs of each pickup run (200)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("peers", f"{(ARGS.server if ARGS else SERVER).rstrip('/')}/bench_peers")

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from leases.tasks import handler, push, push_many  # noqa: E402
from leases.tasks import queue as jobqueue  # noqa: E402
from leases.tasks.models import Job, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402
from leases.tasks.worker import JobWorker  # noqa: E402


@handler(NAME, queue=QUEUE)
def noop(payload: Any) -> None:
    """Nothing: the bench measures the queue, not the work (inherited by forked children)."""
    return None


# -- their side -------------------------------------------------------------------------


def peer_database(server: str) -> str:
    """Procrastinate's database on the same server, made when missing."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_database WHERE datname = 'bench_procrastinate'")
        if cursor.fetchone() is None:
            cursor.execute("CREATE DATABASE bench_procrastinate")
    return f"{server.rstrip('/').replace('postgres://', 'postgresql://', 1)}/bench_procrastinate"


def theirs(url: str, *args: Any) -> dict:
    """One measurement on Procrastinate's side (-P: bench/queue.py must not shadow `queue`)."""
    argv = [str(peer_python("procrastinate")), "-P", str(_HERE / "peer_procrastinate.py"), url, *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"procrastinate {args[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- our side ---------------------------------------------------------------------------


def purge() -> None:
    """Delete the bench's rows, and vacuum: each run starts on a table without the dead
    rows of the last (autovacuum would clear them in a while; the bench cannot wait)."""
    Job.objects.filter(queue=QUEUE).delete()
    WorkerRow.objects.filter(queues=QUEUE).delete()
    with connections["default"].cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {Job._meta.db_table}")


def enqueue(single: int, bulk: int) -> dict:
    purge()
    started = time.perf_counter()
    for i in range(single):
        push(NAME, {"i": i})
    one = single / (time.perf_counter() - started)
    started = time.perf_counter()
    push_many((NAME, {"i": i}) for i in range(single, single + bulk))
    many = bulk / (time.perf_counter() - started)
    purge()
    return {"single": one, "bulk": many}


def _drain_child(concurrency: int, barrier: Any) -> None:
    worker = JobWorker(queues=[QUEUE], concurrency=concurrency, burst=True)
    worker.register()
    barrier.wait(timeout=60)
    worker.run()


def drain(jobs: int, procs: int, concurrency: int) -> dict:
    purge()
    push_many((NAME, {"i": i}) for i in range(jobs))
    with connections["default"].cursor() as cursor:  # statistics current, as on Procrastinate's side
        cursor.execute(f"ANALYZE {Job._meta.db_table}")
    connections.close_all()  # children must not share the parent's connection
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    children = [ctx.Process(target=_drain_child, args=(concurrency, barrier)) for _ in range(procs)]
    for child in children:
        child.start()
    barrier.wait(timeout=60)
    started = time.perf_counter()
    for child in children:
        child.join()
    seconds = time.perf_counter() - started
    done = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    purge()
    return {"jobs": jobs, "done": done, "seconds": seconds, "rate": jobs / seconds}


def _idle_child(listen: bool, ready: Any) -> None:
    worker = JobWorker(queues=[QUEUE], concurrency=1, listen=listen)
    worker.register()
    ready.set()
    worker.run()


def pickup(jobs: int, listen: bool) -> dict:
    """Seconds from each push to its claim, by the server's clock."""
    purge()
    connections.close_all()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_idle_child, args=(listen, ready), daemon=True)
    child.start()
    ready.wait(timeout=60)
    time.sleep(2)  # listening, and past its first polls
    for i in range(jobs):
        time.sleep(random.uniform(0.01, 0.05))
        push(NAME, {"i": i})
    time.sleep(1)
    child.terminate()
    child.join()
    rows = list(Job.objects.filter(queue=QUEUE, started_at__isnull=False).values_list("enqueued_at", "started_at"))
    purge()
    return {"latencies": [(started - pushed).total_seconds() for pushed, started in rows], "jobs": jobs}


# -- report -----------------------------------------------------------------------------


def ms(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def main() -> None:
    args = ARGS
    logging.getLogger("leases").setLevel(logging.ERROR)  # a line per job would time the terminal
    jobs = args.jobs or (2000 if args.quick else 20000)
    shallow = max(100, jobs // 10)  # how the rate depends on the backlog
    pickup_jobs = args.pickup_jobs or (40 if args.quick else 200)
    single, bulk = (300, 5000) if args.quick else (2000, 20000)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    call_command("migrate", verbosity=0, interactive=False)
    Queue.objects.get_or_create(name=QUEUE)
    jobqueue.forget_settings()
    url = peer_database(args.server)
    version = database_version()
    print(f"{version}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    report: dict[str, Any] = {"database": version, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    report["enqueue"] = {"ours": enqueue(single, bulk), "theirs": theirs(url, "enqueue", single, bulk)}
    report["peer"] = f"Procrastinate {report['enqueue']['theirs']['version']}"
    print(f"\nenqueue ({single} one at a time, {bulk} in calls of 1000), jobs/s: ours beside {report['peer']}")
    for kind in ("single", "bulk"):
        mine, peer = report["enqueue"]["ours"][kind], report["enqueue"]["theirs"][kind]
        print(f"  {kind:<6}  ours {mine:>8,.0f}  theirs {peer:>8,.0f}  ratio {mine / peer:5.1f}x", flush=True)

    report["drain"] = []
    for depth in [shallow, jobs]:
        print(f"\ndrain of {depth:,} no-op jobs, 2 worker processes, jobs/s")
        for concurrency in concurrencies:
            mine, peer = drain(depth, 2, concurrency), theirs(url, "drain", depth, 2, concurrency)
            report["drain"].append({"jobs": depth, "concurrency": concurrency, "ours": mine, "theirs": peer})
            print(f"  concurrency {concurrency:>2}  ours {mine['rate']:>7,.0f}  theirs {peer['rate']:>7,.0f}", flush=True)
    best_mine = max(row["ours"]["rate"] for row in report["drain"] if row["jobs"] == jobs)
    best_peer = max(row["theirs"]["rate"] for row in report["drain"] if row["jobs"] == jobs)
    print(f"  best of {jobs:,}: ours {best_mine:,.0f}, theirs {best_peer:,.0f}: {best_mine / best_peer:.1f}x")

    print(f"\npickup latency, {pickup_jobs} jobs pushed one at a time to an idle worker (server clock)")
    report["pickup"] = {"ours, LISTEN/NOTIFY": pickup(pickup_jobs, True),
                        "theirs, LISTEN/NOTIFY": theirs(url, "pickup", pickup_jobs),
                        "ours, polling every 50 ms": pickup(pickup_jobs, False)}
    for label, result in report["pickup"].items():
        values = result["latencies"]
        print(f"  {label:<27} p50 {ms(values, 50):6.1f} ms  p99 {ms(values, 99):6.1f} ms  ({len(values)} jobs)")
    listened = report["pickup"]["ours, LISTEN/NOTIFY"]["latencies"]
    goals = [("drain >= 5x Procrastinate's", best_mine >= 5 * best_peer),
             ("pickup p50 <= 5 ms", ms(listened, 50) <= 5), ("pickup p99 <= 20 ms", ms(listened, 99) <= 20)]
    print("\ngoals: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in goals))
    Queue.objects.filter(name=QUEUE).delete()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
