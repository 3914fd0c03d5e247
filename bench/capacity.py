"""Capacity beyond one server: the same three workloads on one MariaDB server, on the
Galera cluster through HAProxy, split over two databases by LEASES_ROUTES, and on one
PostgreSQL server beside the Patroni cluster through HAProxy (asynchronous, synchronous).

    python bench/capacity.py [--seconds 4] [--procs 4] [--jobs 4000] [--targets one,cluster,two,pg,patroni,patroni-sync]

Workloads, each with --procs processes at once:
  jobs          a queue of --jobs no-op jobs drained by burst Workers (concurrency 4 each)
  lease pairs   pool.acquire() + lease.release() on a pool of 40 resources
  assign calls  Dispatcher.assign_tasks(10) + tasks_done() on a pool of tasks

Targets (each in a process of its own, with its own settings):
  one      one database on the server at 127.0.0.1:3306
  cluster  the Galera cluster of galera/cluster.sh through HAProxy (127.0.0.1:3310: one
           writer, node1); skipped when it does not answer (`make galera-up`)
  two      two databases on the server at 3306, half of the processes on a pool, queue
           and dispatcher routed to each (LEASES_ROUTES)
  pg       one database on the PostgreSQL server at 127.0.0.1:5432
  patroni  the Patroni cluster of pgha/cluster.sh through HAProxy (127.0.0.1:5440: the
           primary), asynchronous replication; skipped when it does not answer (`make pg-ha-up`)
  patroni-sync  the same with synchronous replication (`pgha/cluster.sh mode sync` for
           the run, then back to async): each commit waits for a standby's flush

Everything shares this machine's cores: "two" shows what routing costs and that the
split works, not what two servers would add. Writes the table to stdout and a plot to
bench/capacity.png.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not bench/, whose queue.py would shadow the standard library's

SERVER = "mysql://root@127.0.0.1:3306"
PROXY = "mysql://root@127.0.0.1:3310"
PG_SERVER = "postgres://postgres@127.0.0.1:5432"
PG_PROXY = "postgres://postgres@127.0.0.1:5440"
TARGETS = {
    "one": {"DATABASE_URL": f"{SERVER}/leases_capacity"},
    "cluster": {"DATABASE_URL": f"{PROXY}/leases_capacity"},
    "two": {
        "DATABASE_URL": f"{SERVER}/leases_capacity_a",
        "DATABASE_URL_SECOND": f"{SERVER}/leases_capacity_b",
        "LEASES_ROUTES": json.dumps({kind: {"b-*": "second"} for kind in ("pools", "queues", "dispatchers")}),
    },
    "pg": {"DATABASE_URL": f"{PG_SERVER}/leases_capacity"},
    "patroni": {"DATABASE_URL": f"{PG_PROXY}/leases_capacity"},
    "patroni-sync": {"DATABASE_URL": f"{PG_PROXY}/leases_capacity"},
}
LABELS = {"one": "one server", "cluster": "Galera, 3 nodes, via HAProxy", "two": "two databases",
          "pg": "one PostgreSQL server", "patroni": "Patroni, 3 nodes, async, via HAProxy",
          "patroni-sync": "Patroni, 3 nodes, sync, via HAProxy"}
#: The replication mode a target runs the Patroni cluster in (pgha/cluster.sh mode).
PATRONI_MODE = {"patroni": "async", "patroni-sync": "sync"}
WORKLOADS = {"jobs": "jobs/s", "lease_pairs": "lease pairs/s", "assign_calls": "assign calls/s"}
RESOURCES, TASKS, LIMIT = 40, 30_000, 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each timed loop")
    parser.add_argument("--procs", type=int, default=4, help="processes per workload")
    parser.add_argument("--jobs", type=int, default=4000, help="jobs in the drained queue")
    parser.add_argument("--targets", default="one,cluster,two,pg,patroni,patroni-sync")
    parser.add_argument("--plot", default=str(ROOT / "bench" / "capacity.png"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def answers(url: str) -> bool:
    host, port = url.split("@", 1)[1].split("/", 1)[0].split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


# -- in a target's process ----------------------------------------------------------------


def prefixes(target: str, procs: int) -> list[str]:
    """The name prefix of each process: "a-" everywhere, or half "a-" and half "b-"."""
    return ["b-" if target == "two" and i % 2 else "a-" for i in range(procs)]


def timed(procs: int, loop: Any, args: list[tuple]) -> list[Any]:
    """Run `loop(*args[i])` in `procs` forked processes started together; their results."""
    from django.db import connections

    connections.close_all()  # the children must not share the parent's connections
    ctx = get_context("fork")
    out = ctx.Queue()
    start = time.monotonic() + 0.5

    def child(*a: Any) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        try:
            out.put(loop(*a))
        except BaseException as exc:  # report instead of hanging the parent
            out.put({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            connections.close_all()

    children = [ctx.Process(target=child, args=a) for a in args]
    for c in children:
        c.start()
    results = [out.get(timeout=600) for _ in children]
    for c in children:
        c.join()
    errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
    if errors:
        raise SystemExit(errors[0])
    return results


def settle(seconds: float = 15.0) -> None:
    """Wait until the server has written out the pages the setup dirtied. On this machine
    a bulk write (the dispatcher's 30,000 tasks) is followed by seconds of page flushing
    that slow every COMMIT's fsync tenfold: measure what follows, not that."""
    from django.db import connection

    if connection.vendor != "mysql":
        return
    deadline = time.monotonic() + seconds
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")
            if int(cursor.fetchone()[1]) < 50:
                return
            time.sleep(0.5)


def lease_loop(prefix: str, seconds: float) -> int:
    from leases import Pool

    pool, pairs = Pool(f"{prefix}capacity"), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pool.acquire(ttl=60, wait=5).release()
        pairs += 1
    return pairs


def assign_loop(prefix: str, worker: str, seconds: float) -> int:
    from leases.tasks import Dispatcher

    dispatcher, calls = Dispatcher(f"{prefix}capacity"), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dispatcher.assign_tasks(LIMIT, worker)
        dispatcher.tasks_done(worker)
        calls += 1
    return calls


def drain_loop(prefix: str) -> dict[str, float]:
    from leases.tasks.worker import JobWorker

    worker = JobWorker(queues=[f"{prefix}capacity"], concurrency=4, burst=True, poll=0.02)
    stats = worker.run()
    return {"done": stats.succeeded, "end": time.monotonic()}


def measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    """The three workloads on this process's settings."""
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    from leases import Pool
    from leases.tasks import Dispatcher, handler, push_many
    from leases.tasks.models import Job
    from project.createdb import create_database

    def noop(payload: Any) -> None:
        """Nothing: the bench measures the queue, not the work."""

    mine = prefixes(target, args.procs)
    used = sorted(set(mine))
    for prefix in used:
        handler(f"{prefix}noop", queue=f"{prefix}capacity")(noop)
    aliases = ["default", "second"] if target == "two" else ["default"]
    for alias in aliases:
        create_database(alias)
        call_command("migrate", database=alias, verbosity=0)
    connections.close_all()
    for prefix in used:
        pool = Pool(f"{prefix}capacity")
        pool.resources().delete()
        pool.add_many([(f"r{i}", None) for i in range(RESOURCES)])
        Dispatcher(f"{prefix}capacity", batch_size=5000).recreate_task_pool(
            {f"https://example.test/{i}": float(i % 997) for i in range(TASKS)})
    from bench.benchdb import database_version

    result: dict[str, Any] = {"server": database_version()}

    settle()
    pairs = timed(args.procs, lease_loop, [(p, args.seconds) for p in mine])
    result["lease_pairs"] = sum(pairs) / args.seconds
    settle()
    calls = timed(args.procs, assign_loop, [(p, f"w{i}", args.seconds) for i, p in enumerate(mine)])
    result["assign_calls"] = sum(calls) / args.seconds

    for alias in aliases:
        Job.objects.using(alias).filter(queue__endswith="capacity").delete()
    share = {p: args.jobs // len(used) for p in used}
    for prefix in used:
        push_many([(f"{prefix}noop", {"n": n}) for n in range(share[prefix])])
    settle()
    started = time.monotonic() + 0.5
    drained = timed(args.procs, drain_loop, [(p,) for p in mine])
    done = sum(d["done"] for d in drained)
    if done != sum(share.values()):
        raise SystemExit(f"{target}: the drain finished {done} of {sum(share.values())} jobs")
    result["jobs"] = done / (max(d["end"] for d in drained) - started)
    return result


# -- the parent ---------------------------------------------------------------------------


def plot(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(11, 3.6))
    for ax, (key, label) in zip(axes, WORKLOADS.items()):
        names = list(rows)
        values = [rows[name][key] for name in names]
        bars = ax.bar(range(len(names)), values, color=["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860"][: len(names)])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(names)), [LABELS[name].replace(", ", ",\n") for name in names], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, max(values) * 1.2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return
    rows: dict[str, dict[str, Any]] = {}
    for target in args.targets.split(","):
        # The leases logs at WARNING: a line per job would measure the terminal.
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "LEASES_LOG_LEVEL": "WARNING",
               **TARGETS[target]}
        if not answers(env["DATABASE_URL"]):
            print(f"{LABELS[target]}: skipped, nothing answers at {env['DATABASE_URL']}", file=sys.stderr)
            continue
        child = [sys.executable, __file__, "--child", target, "--seconds", str(args.seconds),
                 "--procs", str(args.procs), "--jobs", str(args.jobs)]
        if target in PATRONI_MODE:
            subprocess.run(["bash", str(ROOT / "pgha" / "cluster.sh"), "mode", PATRONI_MODE[target]], check=True)
        try:
            done = subprocess.run(child, env=env, capture_output=True, text=True)
        finally:
            if target in PATRONI_MODE:
                subprocess.run(["bash", str(ROOT / "pgha" / "cluster.sh"), "mode", "async"], check=True)
        if done.returncode != 0:
            raise SystemExit(f"{target} failed:\n{done.stderr[-3000:]}")
        rows[target] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{LABELS[target]}: " + ", ".join(f"{rows[target][k]:,.0f} {v}" for k, v in WORKLOADS.items()),
              file=sys.stderr)
    if not rows:
        raise SystemExit("no target answered")
    cores = os.cpu_count()
    print(f"\n{args.procs} processes per workload, {cores} cores shared by the clients and every server\n")
    print("| target | " + " | ".join(WORKLOADS.values()) + " |")
    print("|---|" + "---:|" * len(WORKLOADS))
    for target, row in rows.items():
        print(f"| {LABELS[target]} | " + " | ".join(f"{row[k]:,.0f}" for k in WORKLOADS) + " |")
    print("\n" + "\n".join(f"- {LABELS[target]}: {row['server']}" for target, row in rows.items()))
    plot(rows, Path(args.plot), f"{args.procs} processes each, all on one {cores}-core machine")
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
