"""Benchmark of Dispatcher.assign_tasks on a large pool: row locks, one lock, raw SQL.

Each worker process loops `assign_tasks(limit, worker)` then `tasks_done(worker)`, so
every call claims `limit` fresh tasks, for a fixed time. Three variants side by side:
  raw     the same statements as plain SQL on a bare DB-API connection;
  api     the dispatcher as shipped (row locks, SKIP LOCKED where the server has it);
  locked  the Redis design's: the same calls serialised by one dispatcher-wide SQL lock.
Also: the load rate of the pool and the single-call latency of assign_tasks.

    python bench/dispatch.py [--tasks 1000000] [--seconds 3] [--procs 1,4,8] [--limit 100]
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The folder of this file holds queue.py, which on sys.path would shadow the standard
# library's (imported by Django on the way): keep the checkout only.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections  # noqa: E402

from leases.locks import lock  # noqa: E402
from leases.models import Lock  # noqa: E402
from leases.tasks import Dispatcher  # noqa: E402
from leases.tasks.models import DispatchWorker, PoolTask, TaskPool  # noqa: E402

NAME = "bench-dispatch"


def raw_connection():
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        raw = sqlite3.connect(s["NAME"], timeout=30, isolation_level=None)
        return raw, "?", ""
    import MySQLdb
    from MySQLdb.constants import CLIENT

    raw = MySQLdb.connect(host=s["HOST"] or "127.0.0.1", port=int(s["PORT"] or 3306), user=s["USER"],
                          password=s["PASSWORD"], database=s["NAME"], client_flag=CLIENT.FOUND_ROWS,
                          autocommit=True)
    skip = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    return raw, "%s", skip


def raw_round(cur, p: str, skip: str, now: str, worker: str, limit: int) -> int:
    """One assign_tasks + tasks_done in raw SQL; the tasks it got."""
    cur.execute(f"UPDATE leases_tasks_dispatchworker SET last_seen = {now} WHERE dispatcher = {p} AND name = {p}",
                (NAME, worker))
    cur.execute("BEGIN IMMEDIATE" if p == "?" else "BEGIN")
    cur.execute(f"SELECT id, value FROM leases_tasks_pooltask WHERE dispatcher = {p} AND worker = {p}"
                " AND state = 1 ORDER BY assigned_at, score, id", (NAME, worker))
    bucket = cur.fetchall()
    cur.execute(f"SELECT id, value FROM leases_tasks_pooltask WHERE dispatcher = {p} AND state = 0"
                f" ORDER BY score, id LIMIT {p}{skip}", (NAME, limit - len(bucket)))
    ids = [row[0] for row in cur.fetchall()]
    if ids:
        cur.execute(f"UPDATE leases_tasks_pooltask SET state = 1, worker = {p}, assigned_at = {now}"
                    f" WHERE state = 0 AND id IN ({', '.join([p] * len(ids))})", (worker, *ids))
        cur.execute(f"SELECT id, value FROM leases_tasks_pooltask WHERE dispatcher = {p} AND worker = {p}"
                    " AND state = 1 ORDER BY assigned_at, score, id", (NAME, worker))
        bucket = cur.fetchall()
    cur.execute("COMMIT")
    cur.execute(f"UPDATE leases_tasks_pooltask SET state = 2, done_at = {now}"
                f" WHERE dispatcher = {p} AND worker = {p} AND state = 1", (NAME, worker))
    return len(bucket)


def raw_loop(worker: str, limit: int, end: float) -> tuple[int, int]:
    """raw_round until `end`; a deadlock or lock-wait timeout is rolled back and the round
    done again, as the dispatcher's own retries do."""
    raw, p, skip = raw_connection()
    now = "UTC_TIMESTAMP(6)" if p == "%s" else "strftime('%Y-%m-%d %H:%M:%f000', 'now')"
    cur = raw.cursor()
    calls = tasks = 0
    while time.monotonic() < end:
        try:
            got = raw_round(cur, p, skip, now, worker, limit)
        except Exception as exc:  # noqa: BLE001 - the driver's own error type
            if not exc.args or exc.args[0] not in (1205, 1213):
                raise
            cur.execute("ROLLBACK")
            continue
        calls, tasks = calls + 1, tasks + got
    raw.close()
    return calls, tasks


def api_loop(worker: str, limit: int, end: float, one_lock: bool) -> tuple[int, int]:
    d = Dispatcher(NAME)
    calls = tasks = 0
    while time.monotonic() < end:
        if one_lock:
            with lock(f"dispatch:{NAME}", ttl=30, wait=30):
                got = d.assign_tasks(limit, worker)
                d.tasks_done(worker)
        else:
            got = d.assign_tasks(limit, worker)
            d.tasks_done(worker)
        calls, tasks = calls + 1, tasks + len(got)
    return calls, tasks


def child(variant: str, worker: str, limit: int, start: float, seconds: float, out) -> None:
    time.sleep(max(0.0, start - time.monotonic()))
    end = time.monotonic() + seconds
    if variant == "raw":
        result = raw_loop(worker, limit, end)
    else:
        result = api_loop(worker, limit, end, one_lock=variant == "locked")
    connections.close_all()
    out.put(result)


def run(variant: str, procs: int, limit: int, seconds: float) -> tuple[float, float]:
    ctx = get_context("fork")
    out = ctx.Queue()
    connections.close_all()
    start = time.monotonic() + 0.5
    children = [ctx.Process(target=child, args=(variant, f"w{i}", limit, start, seconds, out)) for i in range(procs)]
    for c in children:
        c.start()
    results = [out.get(timeout=seconds + 120) for _ in children]
    for c in children:
        c.join()
    # Put what the run finished back in the pool, so every run claims from a full pool.
    PoolTask.objects.filter(dispatcher=NAME).exclude(state=PoolTask.POOL).update(
        state=PoolTask.POOL, worker=None, assigned_at=None, done_at=None)
    return sum(r[0] for r in results) / seconds, sum(r[1] for r in results) / seconds


def cleanup() -> None:
    PoolTask.objects.filter(dispatcher=NAME).delete()
    DispatchWorker.objects.filter(dispatcher=NAME).delete()
    TaskPool.objects.filter(name=NAME).delete()
    Lock.objects.filter(name__in=[f"dispatch:{NAME}", f"dispatch-rebuild:{NAME}"]).delete()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--procs", default="1,4,8")
    parser.add_argument("--limit", type=int, default=100)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    cleanup()
    connection.ensure_connection()
    version = connection.connection.get_server_info() if connection.vendor == "mysql" else sqlite3.sqlite_version
    print(f"{connection.vendor} {version}; 2 cores; other jobs may be running: compare within this run")
    d = Dispatcher(NAME, batch_size=5000)
    started = time.monotonic()
    d.recreate_task_pool({f"https://example.test/page/{i}": float(i % 9973) for i in range(args.tasks)})
    took = time.monotonic() - started
    print(f"load: {args.tasks} tasks in {took:.1f}s = {args.tasks / took:,.0f} tasks/s")

    latencies = []
    for _ in range(300):
        t = time.perf_counter()
        d.assign_tasks(args.limit, "latency")
        latencies.append((time.perf_counter() - t) * 1000)
        d.tasks_done("latency")
    PoolTask.objects.filter(dispatcher=NAME).exclude(state=PoolTask.POOL).update(
        state=PoolTask.POOL, worker=None, assigned_at=None, done_at=None)
    q = statistics.quantiles(latencies, n=100)
    print(f"assign_tasks({args.limit}) on the full pool, one process: p50 {q[49]:.1f} ms, p95 {q[94]:.1f} ms, "
          f"p99 {q[98]:.1f} ms")

    print(f"{'procs':>5} | {'raw calls/s':>11} | {'api calls/s':>11} | {'one lock calls/s':>16} | "
          f"{'api/raw':>7} | {'api/one lock':>12} | {'raw tasks/s':>11} | {'api tasks/s':>11}")
    for procs in [int(p) for p in args.procs.split(",")]:
        raw = run("raw", procs, args.limit, args.seconds)
        api = run("api", procs, args.limit, args.seconds)
        locked = run("locked", procs, args.limit, args.seconds)
        print(f"{procs:>5} | {raw[0]:>11.0f} | {api[0]:>11.0f} | {locked[0]:>16.0f} | {api[0] / raw[0]:>7.2f} | "
              f"{api[0] / locked[0]:>12.2f} | {raw[1]:>11.0f} | {api[1]:>11.0f}")
    left = PoolTask.objects.filter(dispatcher=NAME, state=PoolTask.POOL).count()
    print(f"pool left: {left} of {args.tasks}")
    cleanup()


if __name__ == "__main__":
    main()
