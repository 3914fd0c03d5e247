"""The scheduler's cost: many schedules due at the same instant, fired by the leader.

    python bench/schedules.py [--database mariadb|postgres|sqlite|URL] [--schedules 10000] [--ticks 2]
                              [--fired N] [--quick]

N schedules of a no-op handler, every 60 s, all due at the same instant (the worst case
of N schedules "every minute"), are made with one bulk insert. The leader's loop then
runs as a worker runs it (`Scheduler.step()` at the worker's poll of 0.05 s, or sooner
when the step says its next pass is due sooner: at the soonest tick) for `--ticks`
minutes. Reported per tick: the leader's wall time and CPU to fire all N, and the spread
from each tick's due time to its job's `enqueued_at` (both by the database clock),
p50/p95/p99/max; goal p99 under 1 s. Beside it, `schedule()` one at a time (the
API's cost per definition). The jobs are not run: firing is what is measured.

New schedules have no history to trim. `--fired N` (N at least LEASES_KEEP_RUNS) makes
them as they are after N ticks, each holding its oldest kept run, so every tick also
drops a run per schedule: the steady state of schedules that have run for a while.

The database is the bench's own: ``mysql://root@127.0.0.1:3306/bench_schedules`` by
default, or ``--database sqlite`` (``/tmp/bench_schedules/db.sqlite3``); its schedules,
runs and jobs are deleted before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timedelta
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
    parser.add_argument("--database", default="mariadb", help="mariadb, postgres, sqlite, or a DATABASE_URL")
    parser.add_argument("--schedules", type=int, default=10_000, help="schedules due at once (10000)")
    parser.add_argument("--ticks", type=int, default=2, help="minutes to run the leader (2)")
    parser.add_argument("--fired", type=int, default=0, help="runs each schedule already fired (0: new ones)")
    parser.add_argument("--quick", action="store_true", help="1,000 schedules, one tick")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("schedules", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402

from leases import conf  # noqa: E402
from leases.clock import db_now  # noqa: E402
from leases.locks import break_lock  # noqa: E402
from leases.tasks import schedule  # noqa: E402
from leases.tasks.models import Job, Schedule, ScheduleRun  # noqa: E402
from leases.tasks.registry import handler  # noqa: E402
from leases.tasks.schedules.leader import LOCK, Scheduler  # noqa: E402

NAME = "benchs.noop"
QUEUE = "bench-schedules"
#: The worker's poll (JobWorker's default).
POLL = 0.05


@handler(NAME, queue=QUEUE)
def noop(payload: object) -> None:
    """Never run here: the bench measures firing."""


def purge() -> None:
    Schedule.objects.all().delete()
    Job.objects.filter(queue=QUEUE).delete()
    break_lock(LOCK)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def bench_define(count: int) -> float:
    """schedule() calls per second, one definition (and transaction) each."""
    began = time.perf_counter()
    for n in range(count):
        schedule(f"defined-{n}", NAME, every=3600)
    rate = count / (time.perf_counter() - began)
    Schedule.objects.filter(name__startswith="defined-").delete()
    return rate


def make(count: int, first_in: float, fired: int) -> datetime:
    """`count` schedules every 60 s, all due `first_in` seconds from now (database clock),
    as they are after `fired` ticks; returns when they are due."""
    now = db_now()
    due = now + timedelta(seconds=first_in)
    last = due - timedelta(seconds=60) if fired else None
    Schedule.objects.bulk_create(
        (Schedule(name=f"s{n:06d}", handler=NAME, every=60.0, timezone="UTC", payload={"n": n},
                  next_fire_at=due, last_fire_at=last, fires=fired, created_at=now, updated_at=now)
         for n in range(count)),
        batch_size=1000,
    )
    keep = conf.keep_runs()
    if fired >= keep:  # the oldest run kept, which the next tick drops
        oldest = due - timedelta(seconds=60 * keep)
        ScheduleRun.objects.bulk_create(
            (ScheduleRun(schedule_id=pk, number=fired - keep + 1, tick_at=oldest, fired_at=oldest,
                         status="succeeded") for pk in Schedule.objects.values_list("pk", flat=True)),
            batch_size=1000,
        )
    return due


def lead(ticks: int, count: int, due: datetime) -> list[dict[str, float]]:
    """Run the leader's loop until `ticks` rounds of `count` runs, from `due` on, have fired."""
    scheduler = Scheduler("bench-leader", ttl=30.0, using="default")
    rounds: list[dict[str, float]] = []
    try:
        for tick in range(ticks):
            wall = cpu = 0.0
            while ScheduleRun.objects.filter(tick_at__gte=due).count() < count * (tick + 1):
                began, used = time.perf_counter(), time.process_time()
                wait = scheduler.step()
                wall += time.perf_counter() - began
                cpu += time.process_time() - used
                time.sleep(min(POLL, wait))  # as the worker's loop waits for its next duty
            rounds.append({"wall_s": wall, "cpu_s": cpu})
            print(f"tick {tick + 1}: fired {count:,} in {wall:.2f} s of the leader's loop ({cpu:.2f} s CPU)",
                  flush=True)
    finally:
        scheduler.stop()
    return rounds


def spreads() -> list[float]:
    """Seconds from each run's tick to its job's enqueued_at, both by the database clock."""
    runs = dict(ScheduleRun.objects.exclude(job_id=None).values_list("job_id", "tick_at"))
    jobs = Job.objects.filter(pk__in=list(runs)).values_list("pk", "enqueued_at")
    return [(queued - runs[pk]).total_seconds() for pk, queued in jobs.iterator(chunk_size=5000)]


def main() -> None:
    count, ticks = (1000, 1) if ARGS.quick else (ARGS.schedules, ARGS.ticks)
    call_command("migrate", verbosity=0)
    purge()
    load = os.getloadavg()
    started = time.monotonic()
    print(f"{database_version()}; {os.cpu_count()} cores; load average {load[0]:.2f}", flush=True)
    defined = bench_define(200 if ARGS.quick else 1000)
    print(f"schedule(): {defined:,.0f} definitions/s, one transaction each", flush=True)
    if ARGS.fired and ARGS.fired < conf.keep_runs():
        sys.exit(f"--fired must be 0 or at least LEASES_KEEP_RUNS ({conf.keep_runs()})")
    due = make(count, first_in=3.0, fired=ARGS.fired)
    rounds = lead(ticks, count, due)
    spread = spreads()
    purge()
    history = f", each after {ARGS.fired:,} ticks" if ARGS.fired else ""
    print(f"\n{count:,} schedules due at the same instant{history}, {ticks} tick(s), the leader's passes at most"
          f" 0.5 s apart:")
    for n, row in enumerate(rounds, 1):
        print(f"  tick {n}: {row['wall_s'] * 1000:,.0f} ms of the leader's time, {row['cpu_s'] * 1000:,.0f} ms CPU,"
              f" {row['wall_s'] / count * 1e6:,.0f} us per schedule")
    print(f"  due -> pushed (database clock): p50 {percentile(spread, 50):.2f} s, p95 {percentile(spread, 95):.2f} s,"
          f" p99 {percentile(spread, 99):.2f} s, max {max(spread):.2f} s over {len(spread):,} runs")
    p99 = percentile(spread, 99)
    print(f"goal: p99 under 1 s: {p99:.2f} s {'met' if p99 < 1 else 'MISSED'}; load average {os.getloadavg()[0]:.2f}"
          f" at end; {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
