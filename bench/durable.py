"""Durable handlers in one run: a step's cost, sleeping jobs, events, async handlers.

What a step costs beside a plain job, sleeping jobs that hold no worker thread, an
event's round trip, and `async def` handlers beside threads.

    python bench/durable.py [--database mariadb|postgres|sqlite|URL] [--quick]
                            [--plain 5000] [--durable 2000] [--steps 5] [--repeat 3]
                            [--sleepers 10000] [--sleep 45] [--events 1000] [--async-jobs 1000]

Workers are `manage.py leases_worker` processes, as operators run them, importing
bench/durable_handlers.py; jobs are pushed with one run time a moment ahead, so each
measurement starts with every job due at once. Rates run from the first job's start to
the last one's end, as the database wrote them.

1. Cost of a step: with 2 workers x concurrency 16, N no-op jobs, then N durable jobs
   that each make k `ctx.step` calls (each step one short transaction of its own, fenced
   by the job's claim), alternating (ABBA): jobs/s and steps/s side by side, and a step's
   cost, (1/durable rate - 1/plain rate) / k, in milliseconds of the whole set-up's time.
2. Sleeping jobs: one worker x 16 takes 10,000 jobs that each `ctx.sleep(S)` once. How
   long until all are suspended (ready, waiting for "sleep"); the worker's threads
   (/proc/<pid>/status) idle, while it suspends them and while they sleep; plain jobs
   pushed one at a time while they sleep, their pickup (started_at - run_at) beside the
   same worker's idle; then each sleep's end to its job's success.
3. An event's round trip: 1,000 jobs suspended in `ctx.wait_for("go")`, then
   `send_event` to each at a steady pace: from the event's sent_at to its job's success.
4. Async handlers: 1,000 `async def` handlers that each await 0.1 s, one worker at
   concurrency 100, beside 1,000 plain ones that sleep 0.1 s in their threads.

As a running server keeps it, each measurement starts on tables emptied and vacuumed
(PostgreSQL), with their statistics current (ANALYZE once the jobs are pushed). The
database is the bench's own, never the project's DATABASE_URL: by default
``mysql://root@127.0.0.1:3306/bench_durable`` (made and migrated when missing).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# The checkout, not this folder: bench/queue.py would shadow the standard library's queue.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, databases, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb",
                        help=f"mariadb, postgres, sqlite, or a URL ({databases('durable')['mariadb']})")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (small counts, one repeat)")
    parser.add_argument("--plain", type=int, default=5000, help="no-op jobs per plain drain (5000)")
    parser.add_argument("--durable", type=int, default=2000, help="durable jobs per drain (2000)")
    parser.add_argument("--steps", type=int, default=5, help="steps per durable job (5)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind, alternating ABBA (3)")
    parser.add_argument("--sleepers", type=int, default=10000, help="jobs that sleep once (10000)")
    parser.add_argument("--sleep", type=float, default=45.0, help="their sleep, seconds (45): longer than"
                        " suspending them all takes")
    parser.add_argument("--probes", type=int, default=100, help="plain jobs pushed one at a time (100)")
    parser.add_argument("--events", type=int, default=1000, help="jobs of the event round trip (1000)")
    parser.add_argument("--event-rate", type=float, default=200.0, help="events sent per second (200)")
    parser.add_argument("--async-jobs", type=int, default=1000, help="async handlers awaiting 0.1 s (1000)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("durable", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.durable_handlers import QUEUE  # noqa: E402
from leases.tasks import push, push_many, send_event  # noqa: E402
from leases.tasks.models import Job, JobError, JobEvent, JobStep, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402

LOGS = Path("/tmp/bench_durable")
PLAIN, STEPS, SLEEPER = "bench.durable.plain", "bench.durable.steps", "bench.durable.sleeper"
WAITER, ASYNC, THREADED = "bench.durable.waiter", "bench.durable.async", "bench.durable.threaded"
SPACING = 0.0137  # between single pushes: not a divisor of the poll, so run times fall all over it


# -- the database -----------------------------------------------------------------------


def tables() -> list[str]:
    return [model._meta.db_table for model in (Job, JobStep, JobEvent, JobError)]


def purge() -> None:
    """Delete the bench queue's jobs with their steps, events and errors, then vacuum
    (PostgreSQL): each measurement starts on tables without the last one's dead rows."""
    job, step, event, error = tables()
    with connection.cursor() as cursor:
        for table in (step, event, error):
            cursor.execute(f"DELETE FROM {table} WHERE job_id IN (SELECT id FROM {job} WHERE queue = %s)",
                           [QUEUE])
        cursor.execute(f"DELETE FROM {job} WHERE queue = %s", [QUEUE])
        if connection.vendor == "postgresql":
            for table in tables():
                cursor.execute(f"VACUUM ANALYZE {table}")


def analyze() -> None:
    """Statistics current once the jobs are pushed (autovacuum or InnoDB's own sampling
    would get there within a minute; a measurement cannot wait for it)."""
    with connection.cursor() as cursor:
        for table in tables():
            if connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()
            else:
                cursor.execute(f"ANALYZE {table}")


def jobs(name: str) -> Any:
    return Job.objects.filter(queue=QUEUE, name=name)


def wait_until(what: str, check: Callable[[], bool], timeout: float, every: float = 0.1) -> float:
    """Seconds until `check()` held, polled every `every`; SystemExit after `timeout`."""
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout:
            raise SystemExit(f"gave up after {timeout:g} s waiting for {what} (worker logs in {LOGS})")
        time.sleep(every)
    return time.monotonic() - began


def all_succeeded(name: str, count: int, timeout: float) -> None:
    def check() -> bool:
        done = jobs(name).filter(status=Job.SUCCEEDED).count()
        if done < count and jobs(name).filter(status__in=Job.FINISHED).exclude(status=Job.SUCCEEDED).exists():
            raise SystemExit(f"{name}: a job ended without succeeding; see {LOGS}")
        return done >= count

    wait_until(f"{count} {name} jobs to succeed", check, timeout, every=0.2)


def span(name: str) -> float:
    """Seconds from the first start of a `name` job to the last end, by the database's clock."""
    found = jobs(name).aggregate(first=Min("started_at"), last=Max("finished_at"))
    return (found["last"] - found["first"]).total_seconds()


def push_due(items: list[tuple[str, Any]], lead: float = 1.5) -> None:
    """Push `items` all due `lead` seconds from now (plus the push's own time), then ANALYZE."""
    at = timezone.now() + timedelta(seconds=lead + len(items) / 20000)
    push_many([(name, payload, {"run_at": at}) for name, payload in items])
    analyze()
    if timezone.now() >= at:
        print("  (pushing took past the run time: the first jobs started before the last were pushed)")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def spread_line(ms: list[float]) -> str:
    return (f"p50 {percentile(ms, 50):,.1f} ms, p99 {percentile(ms, 99):,.1f} ms, max {max(ms):,.1f} ms"
            f" ({len(ms)} jobs)")


# -- worker processes -------------------------------------------------------------------


class Workers:
    """`count` `manage.py leases_worker` processes on the bench's queue; their stderr
    goes to LOGS."""

    def __init__(self, count: int, concurrency: int, label: str) -> None:
        LOGS.mkdir(exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, str(ROOT / "manage.py"), "leases_worker", "--queue", QUEUE,
                "--concurrency", str(concurrency), "--import", "bench.durable_handlers"]
        self.procs = []
        for n in range(count):
            log = open(LOGS / f"{label}-{n}.log", "w")
            self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                               stderr=log))
            log.close()
        wait_until("the workers to register", self._registered, 60)
        time.sleep(1.0)  # their handler threads started, the first polls done: idle

    def _registered(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise SystemExit(f"a worker exited with {proc.returncode} at start; see {LOGS}")
        names = WorkerRow.objects.filter(queues=QUEUE).values_list("name", flat=True)
        return all(any(f":{proc.pid}:" in name for name in names) for proc in self.procs)

    def status(self, index: int = 0) -> dict[str, int]:
        """Threads and resident kB of a worker process, from /proc."""
        found = {}
        for line in Path(f"/proc/{self.procs[index].pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                found[key] = int(value.split()[0])
        return found

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        WorkerRow.objects.filter(queues=QUEUE).delete()


class Sampler(threading.Thread):
    """Reads a worker's threads and memory every 0.1 s, keeping the most of each per
    phase the bench names (`phase`)."""

    def __init__(self, workers: Workers) -> None:
        super().__init__(daemon=True)
        self.workers, self.phase, self.most = workers, "idle", {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            try:
                now = self.workers.status()
            except OSError:
                return
            mine = self.most.setdefault(self.phase, {"Threads": 0, "VmRSS": 0})
            for key, value in now.items():
                mine[key] = max(mine[key], value)


# -- 1. the cost of a step ----------------------------------------------------------------


def drain(name: str, count: int, k: int) -> dict[str, float]:
    """One drain of `count` jobs of `name`, all due at once, by the running workers."""
    purge()
    extra = {"k": k} if name == STEPS else {}
    push_due([(name, {"n": n, **extra}) for n in range(count)])  # distinct: the key is a hash of them
    all_succeeded(name, count, timeout=120 + count / 20)
    seconds = span(name)
    run = {"jobs": count, "seconds": seconds, "jobs_per_s": count / seconds}
    if name == STEPS:
        handler_ms = [result["ms"] for result in jobs(name).values_list("result", flat=True)]
        run["steps_per_s"] = count * k / seconds
        run["handler_ms_per_step"] = statistics.mean(handler_ms) / k
        stored = JobStep.objects.filter(job__queue=QUEUE, job__name=name).count()
        if stored != count * k:
            raise SystemExit(f"{stored} steps stored for {count} jobs x {k}")
    print(f"  {name}: {count:,} jobs in {seconds:.2f} s, {run['jobs_per_s']:,.0f} jobs/s", flush=True)
    return run


def bench_steps(plain: int, durable: int, k: int, repeat: int) -> dict[str, Any]:
    print(f"\n1. cost of a step: 2 workers x 16; {plain:,} no-op jobs, {durable:,} jobs of {k} steps,"
          f" ABBA x{repeat}", flush=True)
    workers = Workers(2, 16, "steps")
    runs: dict[str, list[dict]] = {PLAIN: [], STEPS: []}
    try:
        for i in range(repeat):
            for name in (PLAIN, STEPS) if i % 2 == 0 else (STEPS, PLAIN):
                runs[name].append(drain(name, plain if name == PLAIN else durable, k))
    finally:
        workers.stop()
        purge()
    plain_rate = statistics.median(r["jobs_per_s"] for r in runs[PLAIN])
    durable_rate = statistics.median(r["jobs_per_s"] for r in runs[STEPS])
    return {"plain": runs[PLAIN], "durable": runs[STEPS], "k": k, "plain_jobs_per_s": plain_rate,
            "durable_jobs_per_s": durable_rate, "steps_per_s": durable_rate * k,
            "step_ms": (1 / durable_rate - 1 / plain_rate) / k * 1000,
            "handler_ms_per_step": statistics.median(r["handler_ms_per_step"] for r in runs[STEPS])}


# -- 2. sleeping jobs ---------------------------------------------------------------------


def probe(count: int) -> list[float]:
    """Push `count` plain jobs one at a time, SPACING apart; their pickup, started_at -
    run_at (both the database's clock), in ms."""
    first = jobs(PLAIN).aggregate(last=Max("id"))["last"] or 0
    for n in range(count):
        push(PLAIN, {"probe": n, "after": first})
        time.sleep(SPACING)
    mine = jobs(PLAIN).filter(id__gt=first)
    wait_until("the probe jobs", lambda: mine.filter(status=Job.SUCCEEDED).count() >= count, 60)
    times = mine.values_list("run_at", "started_at")
    return [(started - run).total_seconds() * 1000 for run, started in times]


def bench_sleepers(count: int, sleep: float, probes: int, events: int, event_rate: float) -> dict[str, Any]:
    print(f"\n2. {count:,} jobs that sleep {sleep:g} s once, one worker x 16", flush=True)
    purge()
    workers = Workers(1, 16, "sleep")
    sampler = Sampler(workers)
    sampler.start()
    out: dict[str, Any] = {"jobs": count, "sleep": sleep}
    try:
        time.sleep(0.5)
        out["idle"] = workers.status()
        out["probe_idle_ms"] = probe(probes)
        print(f"  worker idle: {out['idle']['Threads']} threads, {out['idle']['VmRSS'] / 1024:.0f} MB;"
              f" plain jobs' pickup {spread_line(out['probe_idle_ms'])}", flush=True)
        asleep = jobs(SLEEPER).filter(status=Job.READY, waiting_for="sleep")
        sampler.phase = "suspending"
        began = time.monotonic()
        push_many((SLEEPER, {"n": n, "s": sleep}) for n in range(count))
        out["push_s"] = time.monotonic() - began
        wait_until("every sleeper to suspend", lambda: asleep.count() >= count, 600, every=0.2)
        out["suspend_s"] = time.monotonic() - began
        sampler.phase = "sleeping"
        analyze()
        sleeps = JobStep.objects.filter(job__queue=QUEUE, name="sleep")
        ends = sleeps.aggregate(first=Min("until"), last=Max("until"))
        left = (ends["first"] - timezone.now()).total_seconds()
        print(f"  all {count:,} suspended {out['suspend_s']:.1f} s after the push began"
              f" ({count / out['suspend_s']:,.0f} jobs/s); the first sleep ends {left:.1f} s later",
              flush=True)
        if left < probes * SPACING + 5:
            raise SystemExit("the sleeps end too soon to measure anything while they sleep: raise --sleep")
        out["running_while_asleep"] = jobs(SLEEPER).filter(status=Job.RUNNING).count()
        out["probe_asleep_ms"] = probe(probes)
        time.sleep(1.0)
        out["asleep"] = workers.status()
        still = asleep.count()
        out["asleep_sampled"] = sampler.most["sleeping"]
        out["suspending_sampled"] = sampler.most.get("suspending", {})
        print(f"  while they sleep ({still:,} still asleep): {out['asleep']['Threads']} threads"
              f" (most seen {out['asleep_sampled']['Threads']}), {out['asleep']['VmRSS'] / 1024:.0f} MB;"
              f" {out['running_while_asleep']} sleepers running; plain jobs' pickup"
              f" {spread_line(out['probe_asleep_ms'])}", flush=True)
        sampler.phase = "waking"
        all_succeeded(SLEEPER, count, timeout=sleep + 600)
        last_done = jobs(SLEEPER).aggregate(last=Max("finished_at"))["last"]
        out["resume_from_first_end_s"] = (last_done - ends["first"]).total_seconds()
        out["sleep_ends_spread_s"] = (ends["last"] - ends["first"]).total_seconds()
        until = dict(sleeps.values_list("job_id", "until"))
        out["lag_ms"] = [(done - until[pk]).total_seconds() * 1000
                         for pk, done in jobs(SLEEPER).values_list("id", "finished_at")]
        out["waking_sampled"] = sampler.most.get("waking", {})
        print(f"  sleeps ended over {out['sleep_ends_spread_s']:.1f} s (as they began); all succeeded"
              f" {out['resume_from_first_end_s']:.1f} s after the first end; a sleep's end to its job's"
              f" success: {spread_line(out['lag_ms'])}", flush=True)
        if events:
            out["events"] = bench_events(events, event_rate)
    finally:
        sampler.done.set()
        workers.stop()
        purge()
    return out


# -- 3. an event's round trip ---------------------------------------------------------------


def bench_events(count: int, rate: float) -> dict[str, Any]:
    """`count` jobs suspended in wait_for("go"), then an event to each, `rate` a second."""
    print(f"\n3. event round trip: {count:,} jobs waiting for 'go', events sent {rate:g}/s, same worker",
          flush=True)
    purge()
    push_many((WAITER, {"n": n}) for n in range(count))
    waiting = jobs(WAITER).filter(status=Job.READY, waiting_for="event:go")
    wait_until("every waiter to suspend", lambda: waiting.count() >= count, 300, every=0.2)
    analyze()
    ids = list(jobs(WAITER).values_list("id", flat=True))
    began = time.monotonic()
    for n, pk in enumerate(ids):
        send_event(pk, "go", {"n": n})
        pause = began + (n + 1) / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    sent_s = time.monotonic() - began
    all_succeeded(WAITER, count, timeout=300)
    sent = dict(JobEvent.objects.filter(job__queue=QUEUE).values_list("job_id", "sent_at"))
    finished = jobs(WAITER).values_list("id", "finished_at", "result")
    wrong = sum(1 for pk, _, result in finished if result != {"n": ids.index(pk)})
    ms = [(done - sent[pk]).total_seconds() * 1000 for pk, done, _ in finished]
    print(f"  {count:,} events sent in {sent_s:.1f} s; sent_at to the job's success {spread_line(ms)};"
          f" {wrong} results not their event's data", flush=True)
    return {"jobs": count, "rate": rate, "sent_s": sent_s, "ms": ms, "wrong": wrong}


# -- 4. async handlers --------------------------------------------------------------------


def bench_async(count: int, repeat: int) -> dict[str, Any]:
    print(f"\n4. {count:,} handlers awaiting 0.1 s, one worker x 100: async def beside threads,"
          f" ABBA x{repeat}", flush=True)
    purge()
    workers = Workers(1, 100, "async")
    sampler = Sampler(workers)
    sampler.start()
    runs: dict[str, list[float]] = {ASYNC: [], THREADED: []}
    alone = None
    try:
        time.sleep(0.5)
        for i in range(repeat):
            for name in (ASYNC, THREADED) if i % 2 == 0 else (THREADED, ASYNC):
                purge()
                sampler.phase = name
                push_due([(name, {"n": n}) for n in range(count)])
                all_succeeded(name, count, timeout=120)
                runs[name].append(span(name))
                if i == 0 and name == ASYNC:  # before any threaded run has started its threads
                    alone = sampler.most.get(ASYNC, {}).get("Threads")
                print(f"  {name}: {count:,} in {runs[name][-1]:.2f} s ({count / runs[name][-1]:,.0f} jobs/s;"
                      f" 100 at a time without overhead: {count / 100 * 0.1:.1f} s)", flush=True)
    finally:
        sampler.done.set()
        workers.stop()
        purge()
    threads = {phase: most["Threads"] for phase, most in sampler.most.items()}
    threads["async_alone"] = alone
    print(f"  the worker's threads, most seen: idle {threads.get('idle')}, running async handlers {alone}"
          f" (its loop, and the loop's executor), running threaded ones {threads.get(THREADED)}", flush=True)
    return {"jobs": count, "runs": runs, "threads": threads,
            **{name: statistics.median(found) for name, found in runs.items()}}


# -- report ---------------------------------------------------------------------------------


def print_summary(version: str, steps: dict, sleepers: dict | None, aio: dict | None) -> None:
    print(f"\n{version}; {os.cpu_count()} cores")
    k = steps["k"]
    print(f"{'':34} | {'jobs/s':>8} | {'steps/s':>8} | handler ms per step")
    print(f"{'plain no-op jobs':34} | {steps['plain_jobs_per_s']:>8,.0f} | {'':>8} |")
    print(f"{f'durable jobs, {k} steps each':34} | {steps['durable_jobs_per_s']:>8,.0f} | "
          f"{steps['steps_per_s']:>8,.0f} | {steps['handler_ms_per_step']:.2f}")
    print(f"a step costs {steps['step_ms']:.3f} ms of the set-up's time ((1/durable - 1/plain) / {k});"
          f" a durable job of {k} steps costs {steps['plain_jobs_per_s'] / steps['durable_jobs_per_s']:.1f}"
          " plain ones")
    if sleepers:
        s = sleepers
        print(f"{s['jobs']:,} sleepers: suspended in {s['suspend_s']:.1f} s; worker threads idle"
              f" {s['idle']['Threads']}, suspending (most) {s['suspending_sampled'].get('Threads', '-')},"
              f" asleep {s['asleep']['Threads']};"
              f" plain pickup p50/p99 idle {percentile(s['probe_idle_ms'], 50):.1f}/"
              f"{percentile(s['probe_idle_ms'], 99):.1f} ms, with them asleep"
              f" {percentile(s['probe_asleep_ms'], 50):.1f}/{percentile(s['probe_asleep_ms'], 99):.1f} ms;"
              f" resumed and succeeded {s['resume_from_first_end_s']:.1f} s after the first sleep's end,"
              f" lag p50/p99 {percentile(s['lag_ms'], 50):.0f}/{percentile(s['lag_ms'], 99):.0f} ms")
        if "events" in s:
            ms = s["events"]["ms"]
            print(f"event round trip: p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms")
    if aio:
        print(f"async: {aio['jobs']:,} x await 0.1 s at concurrency 100 in {aio[ASYNC]:.2f} s"
              f" (threads: {aio[THREADED]:.2f} s; goal about {aio['jobs'] / 100:.0f} s,"
              f" 100 at a time without overhead {aio['jobs'] / 1000:.1f} s); the worker's threads: async"
              f" {aio['threads'].get('async_alone')}, threaded {aio['threads'].get(THREADED)}")


def main() -> None:
    args = ARGS
    import logging

    logging.getLogger("leases").setLevel(logging.ERROR)
    if args.quick:
        args.plain, args.durable, args.repeat, args.sleepers, args.sleep = 1000, 400, 1, 1000, 15.0
        args.probes, args.events, args.async_jobs = 40, 200, 300
    call_command("migrate", verbosity=0, interactive=False)
    Queue.objects.get_or_create(name=QUEUE)
    WorkerRow.objects.filter(queues=QUEUE).delete()
    version = database_version()
    load = os.getloadavg()
    print(f"{version}; {os.cpu_count()} cores, load average {load[0]:.2f}; queue {QUEUE}", flush=True)
    started = time.monotonic()
    report: dict[str, Any] = {"database": version, "cores": os.cpu_count(), "load_at_start": load,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["steps"] = bench_steps(args.plain, args.durable, args.steps, args.repeat)
    report["sleepers"] = (bench_sleepers(args.sleepers, args.sleep, args.probes, args.events, args.event_rate)
                          if args.sleepers else None)
    report["async"] = bench_async(args.async_jobs, args.repeat) if args.async_jobs else None
    print_summary(version, report["steps"], report["sleepers"], report["async"])
    print(f"\nload average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{time.monotonic() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
