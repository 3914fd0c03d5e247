"""A soak of the job queue under every fault at once, through tests/faultproxy.py.

    python bench/soak.py [--jobs 20000] [--workers 4] [--concurrency 4] [--job-seconds 0.4]
                         [--drop 0.03] [--kill-every 5] [--outage-at 120] [--outage 15]
                         [--limit 900] [--json FILE]

`--workers` `manage.py leases_worker` processes drain `--jobs` jobs (each sleeps
`--job-seconds` and appends "n pid" to a log) on MariaDB through the fault proxy, which
drops the reply of `--drop` of all COMMITs (after the server committed them). Every
`--kill-every` seconds one worker is SIGKILLed and a fresh one started in its place; at
`--outage-at` seconds the proxy cuts every connection and refuses new ones for `--outage`
seconds. When every job has succeeded (or `--limit` seconds passed), the live workers get
SIGTERM. The verdict: every job succeeded, none is left ready or running, no worker died
but the killed ones, and each run beyond a job's first is attributed to its cause: the job
was running in a killed worker, or its worker lost its lease while cut off (the outage or
a lost reply). The database is the soak's own (`mysql://root@127.0.0.1:3306/soak`, made
and migrated when missing); the project's DATABASE_URL is never touched.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# The checkout, not this folder: bench/queue.py would shadow the standard library's queue.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]
DATABASE = "mysql://root@127.0.0.1:3306/soak"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--job-seconds", type=float, default=0.4)
    parser.add_argument("--ttl", type=float, default=3.0, help="the workers' --ttl")
    parser.add_argument("--drop", type=float, default=0.03, help="share of COMMIT replies lost")
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between SIGKILLs (0: none)")
    parser.add_argument("--outage-at", type=float, default=120.0)
    parser.add_argument("--outage", type=float, default=15.0, help="seconds of refused connections (0: none)")
    parser.add_argument("--limit", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="also write the verdict as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
os.environ["DATABASE_URL"] = DATABASE
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def create_database() -> None:
    import MySQLdb

    conn = MySQLdb.connect(host="127.0.0.1", port=3306, user="root")
    try:
        conn.cursor().execute("CREATE DATABASE IF NOT EXISTS soak CHARACTER SET utf8mb4")
    finally:
        conn.close()


create_database()
import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db.models import Count  # noqa: E402

import tests.jobs  # noqa: E402,F401 - the "sleepy" handler
from leases.tasks import push_many  # noqa: E402
from leases.tasks.models import Job, JobError, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402
from tests.faults.faultproxy import FaultProxy  # noqa: E402

LOST = "leases.exceptions.WorkerLost"


class Fleet:
    """The worker processes, started through the proxy; remembers which were killed."""

    def __init__(self, port: int, workdir: Path, args: argparse.Namespace) -> None:
        url = DATABASE.replace(":3306/", f":{port}/") + "?read_timeout=5&write_timeout=5&connect_timeout=3"
        self.env = {**os.environ, "DATABASE_URL": url, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.workdir, self.args = workdir, args
        self.live: list[subprocess.Popen] = []
        self.killed: list[subprocess.Popen] = []
        self.started = 0

    def start(self) -> subprocess.Popen:
        argv = [sys.executable, str(ROOT / "manage.py"), "leases_worker", "--import", "tests.jobs",
                "--queue", "default", "--concurrency", str(self.args.concurrency), "--ttl", str(self.args.ttl)]
        err = open(self.workdir / f"worker-{self.started}.log", "w")
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=err)
        proc.log = err.name
        self.started += 1
        self.live.append(proc)
        return proc

    def kill_one(self, rng: random.Random) -> None:
        proc = rng.choice(self.live)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.live.remove(proc)
        self.killed.append(proc)
        self.start()

    def died(self) -> list[subprocess.Popen]:
        return [proc for proc in self.live if proc.poll() is not None]

    def stop(self) -> dict[int, int | None]:
        """SIGTERM to every live worker: their exit codes, None for one that would not stop."""
        for proc in self.live:
            proc.send_signal(signal.SIGTERM)
        codes: dict[int, int | None] = {}
        for proc in self.live:
            try:
                codes[proc.pid] = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[proc.pid] = None
        return codes


def count(status: int) -> int:
    return Job.objects.filter(status=status).count()


def main(args: argparse.Namespace) -> int:
    call_command("migrate", verbosity=0)
    Job.objects.all().delete()
    WorkerRow.objects.all().delete()
    Queue.objects.get_or_create(name="default")
    workdir = Path("/tmp/soak")
    workdir.mkdir(exist_ok=True)
    for old in workdir.glob("*.log"):
        old.unlink()
    runs_log = workdir / "runs.log"
    items = [("sleepy", {"n": n, "seconds": args.job_seconds, "log": str(runs_log)}, {"max_attempts": 20})
             for n in range(args.jobs)]
    push_many(items)
    rng = random.Random(args.seed)
    with FaultProxy(upstream=("127.0.0.1", 3306)) as proxy:
        drops = proxy.drop_reply(r"^\s*COMMIT\b", probability=args.drop, seed=args.seed)
        fleet = Fleet(proxy.port, workdir, args)
        for _ in range(args.workers):
            fleet.start()
        began = time.monotonic()
        next_kill = began + args.kill_every if args.kill_every else float("inf")
        outage_at = began + args.outage_at if args.outage else float("inf")
        unexpected: list[str] = []
        print(f"soak: {args.jobs} jobs, {args.workers} workers x {args.concurrency}, {args.drop:.0%} of COMMIT "
              f"replies dropped, a SIGKILL every {args.kill_every:g}s, {args.outage:g}s outage at {args.outage_at:g}s")
        while True:
            now = time.monotonic()
            done = count(Job.SUCCEEDED)
            if done == args.jobs or now - began > args.limit:
                break
            if now >= outage_at:
                print(f"{now - began:6.0f}s  outage: connections refused for {args.outage:g}s")
                proxy.refuse(args.outage)
                outage_at = float("inf")
            if now >= next_kill:
                fleet.kill_one(rng)
                next_kill = now + args.kill_every
            for proc in fleet.died():
                unexpected.append(f"worker {proc.pid} exited with {proc.returncode}: see {proc.log}")
                fleet.live.remove(proc)
                fleet.start()
            if int(now - began) % 30 == 0:
                print(f"{now - began:6.0f}s  succeeded {done}, running {count(Job.RUNNING)}, "
                      f"ready {count(Job.READY)}, kills {len(fleet.killed)}, drops {drops.dropped}")
            time.sleep(1.0 - (time.monotonic() - now) % 1.0)
        elapsed = time.monotonic() - began
        codes = fleet.stop()
        dropped = drops.dropped
    return report(args, runs_log, fleet, codes, unexpected, elapsed, dropped)


def report(args, runs_log: Path, fleet: Fleet, codes: dict, unexpected: list, elapsed: float, dropped: int) -> int:
    runs = Counter(int(line.split()[0]) for line in runs_log.read_text().splitlines())
    killed = {f":{proc.pid}:" for proc in fleet.killed}
    lost_by: dict[int, list[str]] = {}
    for job_id, worker in JobError.objects.filter(exception=LOST).values_list("job_id", "worker"):
        lost_by.setdefault(job_id, []).append(worker)
    payload_n = dict(Job.objects.values_list("pk", "payload__n"))
    by_kill = by_cutoff = unexplained = 0
    for pk, n in payload_n.items():
        extra = runs.get(n, 0) - 1
        if extra <= 0:
            continue
        workers = lost_by.get(pk, [])
        if any(any(mark in worker for mark in killed) for worker in workers):
            by_kill += extra
        elif workers:
            by_cutoff += extra
        else:
            unexplained += extra
    statuses = dict(Job.objects.values_list("status").annotate(n=Count("id")))
    verdict = {
        "jobs": args.jobs,
        "seconds": round(elapsed),
        "succeeded": statuses.get(Job.SUCCEEDED, 0),
        "left_ready_or_running": statuses.get(Job.READY, 0) + statuses.get(Job.RUNNING, 0),
        "failed_or_dead": statuses.get(Job.FAILED, 0) + statuses.get(Job.DEAD, 0),
        "never_ran": sum(1 for n in payload_n.values() if runs.get(n, 0) == 0),
        "runs": sum(runs.values()),
        "double_runs": sum(count - 1 for count in runs.values() if count > 1),
        "double_runs_after_a_kill": by_kill,
        "double_runs_after_a_cut_off_worker": by_cutoff,
        "double_runs_unexplained": unexplained,
        "kills": len(fleet.killed),
        "commit_replies_dropped": dropped,
        "workers_started": fleet.started,
        "workers_died_unkilled": len(unexpected),
        "worker_exit_codes": sorted({str(code) for code in codes.values()}),
        "recovered_attempts": sum(len(w) for w in lost_by.values()),
    }
    for line in unexpected:
        print("UNEXPECTED:", line)
    print(json.dumps(verdict, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(verdict, indent=2))
    ok = (
        verdict["succeeded"] == args.jobs
        and not verdict["left_ready_or_running"]
        and not verdict["workers_died_unkilled"]
        and verdict["worker_exit_codes"] == ["0"]
        and not verdict["double_runs_unexplained"]
    )
    print("soak:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
