"""The claim of jobs that hold resources at size: one site and 40 resources beside 1,000
sites, 10,000 resources and 5,000 per-site bans and rests in force, in one run.

    python bench/scale.py [--database mariadb|postgres|sqlite|URL] [--jobs 100000]
                          [--sites 1000] [--resources 10000] [--refusals 5000]
                          [--seconds 20] [--concurrency N] [--repeat 2] [--explain] [--quick]

Each shape is set up from empty tables: the pool's resources, the refusals (half bans,
half rests, an hour long, each on a random resource for a random site), then `--jobs`
waiting jobs of a 5 ms handler that holds one resource, their sites taken in turn;
vacuumed (PostgreSQL) and ANALYZEd, as a running server keeps them. Then 2
`manage.py leases_worker` processes at their defaults (bench/scale_handlers.py) take
jobs: after a warm-up of 3 s, the jobs ended within `--seconds` give the claim rate.
The shapes alternate (small, large, small, ...); the goal is the large shape at 0.8 of
the small one's rate or better. `--explain` prints the plans of the claim's reads at the
large shape, as the server ran them.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, databases, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb",
                        help=f"mariadb, postgres, sqlite, or a URL ({databases('scale')['mariadb']})")
    parser.add_argument("--jobs", type=int, default=100_000, help="waiting jobs in each shape (100000)")
    parser.add_argument("--sites", type=int, default=1000, help="sites of the large shape (1000)")
    parser.add_argument("--resources", type=int, default=10_000, help="resources of the large shape (10000)")
    parser.add_argument("--refusals", type=int, default=5000, help="bans and rests of the large shape (5000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run (20)")
    parser.add_argument("--concurrency", type=int, help="the workers' --concurrency (their default)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each shape, alternating (2)")
    parser.add_argument("--explain", action="store_true", help="print the claim's plans at the large shape")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (small counts, one run)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.sites, args.resources, args.refusals = 3000, 50, 500, 200
        args.seconds, args.repeat = 4.0, 1
    return args


ARGS = parse_args() if __name__ == "__main__" else None
setup("scale", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.scale_handlers import POOL, QUEUE  # noqa: E402
from leases import Pool  # noqa: E402
from leases.models import Resource, ResourceTarget  # noqa: E402
from leases.sql import in_list  # noqa: E402
from leases.tasks import push_many  # noqa: E402
from leases.tasks import sql as task_sql  # noqa: E402
from leases.tasks.jobs.leasing import FREE_READ  # noqa: E402
from leases.tasks.models import Affinity, Job, JobError, PoolTurn  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402

LOGS = Path("/tmp/bench_scale")
MODELS = (Job, JobError, Resource, ResourceTarget, PoolTurn, Affinity)


def fill(sites: int, resources: int, refusals: int, jobs: int) -> None:
    """Empty the bench's tables, then the shape: resources, refusals, waiting jobs."""
    with connection.cursor() as cursor:
        for model in MODELS:
            cursor.execute(f"DELETE FROM {model._meta.db_table}")
    pool = Pool(POOL)
    pool.add_many((f"r{n:05d}", None) for n in range(resources))
    rng, until = random.Random(7), timezone.now() + timedelta(hours=1)
    pairs = {(rng.randrange(resources), rng.randrange(sites)) for _ in range(refusals * 2)}
    rows = [ResourceTarget(pool=POOL, name=f"r{r:05d}", target=f"site{s:04d}", updated_at=timezone.now(),
                           banned_until=until if n % 2 else None, ban_reason="bench" if n % 2 else "",
                           rested_until=None if n % 2 else until)
            for n, (r, s) in enumerate(sorted(pairs)[:refusals])]
    ResourceTarget.objects.bulk_create(rows, batch_size=1000)
    push_many(("bench.scale.crawl", {"site": f"site{n % sites:04d}", "n": n}) for n in range(jobs))
    with connection.cursor() as cursor:
        for model in MODELS:
            table = model._meta.db_table
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {table}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()


def ended() -> int:
    return Job.objects.filter(queue=QUEUE).exclude(status__in=(Job.READY, Job.RUNNING)).count()


def measure(label: str) -> float:
    """Jobs/s of 2 workers at their defaults over ARGS.seconds, after a 3 s warm-up."""
    LOGS.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, str(ROOT / "manage.py"), "leases_worker", "--queue", QUEUE,
            "--import", "bench.scale_handlers", "-v", "0"]
    if ARGS.concurrency:
        argv += ["--concurrency", str(ARGS.concurrency)]
    procs = []
    for n in range(2):
        with open(LOGS / f"{label}-{n}.log", "w") as log:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log))
    try:
        began = time.monotonic()
        while ended() == 0:
            if time.monotonic() - began > 60 or any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"{label}: no job ended within 60 s; see {LOGS}")
            time.sleep(0.2)
        time.sleep(3.0)
        first, start = ended(), time.monotonic()
        time.sleep(ARGS.seconds)
        last, stop = ended(), time.monotonic()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    failed = Job.objects.filter(queue=QUEUE).exclude(status__in=(Job.READY, Job.RUNNING, Job.SUCCEEDED)).count()
    if failed:
        raise SystemExit(f"{label}: {failed} job(s) ended without succeeding; see {LOGS}")
    WorkerRow.objects.filter(queues=QUEUE).delete()
    return (last - first) / (stop - start)


def explain() -> None:
    """The plans of the claim's reads at this shape, as the server ran them: a lane's due
    jobs, the pool's longest free slots, which of them 16 sites refuse, and one site's own
    read (the claim's fallback, and a Pool acquirer's for a target)."""
    sites = sorted(set(ResourceTarget.objects.filter(pool=POOL).values_list("target", flat=True)[:16]))
    names = sorted(Resource.objects.filter(pool=POOL).order_by("busy_before", "id").values_list("name", flat=True)[:64])
    st = task_sql.leasing(connection)
    refused = st.refused + in_list(sites) + " AND name IN (" + in_list(names)
    reads = {
        "a lane's due jobs": (task_sql.jobs(connection).due, [QUEUE, POOL, 64]),
        "the pool's longest free slots": (st.free, [POOL, FREE_READ]),
        f"which of them {len(sites)} sites refuse": (refused, [POOL, *sites, *names]),
        "one site's own read": (st.free_for, [POOL, POOL, sites[0] if sites else "", FREE_READ]),
    }
    prefix = {"postgresql": "EXPLAIN (ANALYZE, BUFFERS) ", "mysql": "ANALYZE ", "sqlite": "EXPLAIN QUERY PLAN "}
    for what, (statement, params) in reads.items():
        print(f"\n  {what}:")
        with connection.cursor() as cursor:
            cursor.execute(prefix[connection.vendor] + statement, params)
            for row in cursor.fetchall():
                print("    " + "  ".join(str(value) for value in row))


def main() -> None:
    call_command("migrate", verbosity=0)
    large = (ARGS.sites, ARGS.resources, ARGS.refusals)
    shapes = {"1 site, 40 resources": (1, 40, 0),
              f"{large[0]:,} sites, {large[1]:,} resources, {large[2]:,} refusals": large}
    concurrency = ARGS.concurrency or "the default"
    print(f"{database_version()}; {ARGS.jobs:,} waiting jobs of 5 ms; 2 leases_worker at concurrency"
          f" {concurrency}; {ARGS.seconds:g} s measured per run", flush=True)
    rates: dict[str, list[float]] = {label: [] for label in shapes}
    for run in range(ARGS.repeat):
        for label, shape in shapes.items():
            fill(*shape, ARGS.jobs)
            rates[label].append(measure(f"run{run}-{shape[0]}"))
            print(f"  {label}: {rates[label][-1]:,.0f} jobs/s", flush=True)
            if ARGS.explain and shape == large and run == 0:
                explain()
    small, big = (statistics.median(values) for values in rates.values())
    print(f"\nmedians: {small:,.0f} against {big:,.0f} jobs/s: {big / small:.2f} of the small shape's rate"
          " (goal: 0.8 or more)")


if __name__ == "__main__":
    main()
