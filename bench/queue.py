"""The job queue's rates beside a raw-SQL claim loop on the same database, in one run.

    python bench/queue.py [--database mariadb|sqlite|URL] [--quick] [--drain-jobs 20000] [--repeat 2]

* enqueue: ``push()`` one job at a time, and ``push_many()`` in batches of 1000, beside a
  parameterised INSERT per job and a 1000-row INSERT on the driver's own cursor; then
  one push and one bare INSERT by turns, each call timed, whose medians' ratio a burst of
  load on a shared machine moves far less than the blocks' rates;
* drain: N no-op jobs preloaded, then 1 or 2 forked processes each running
  ``JobWorker(concurrency=C, burst=True)`` until the queue is empty; jobs/s = N / wall time.
  Beside it the raw loop in the same processes, with no threads: one transaction that
  selects C ready rows FOR UPDATE SKIP LOCKED (SQLite: BEGIN IMMEDIATE) and marks them
  running, then one UPDATE that marks them succeeded. That loop is the ceiling of the
  worker's protocol (two commits per claim), so api/raw says what the worker adds;
* pickup: jobs pushed with a 0.2 s delay to an idle worker at the default poll (0.05 s);
  latency = started_at - run_at as the server wrote them, beside the raw loop polling
  at the same interval.

Raw and api drain runs alternate (ABBA) so a drift in the machine's load favours
neither. The database is the bench's own, never the project's DATABASE_URL: by default
``mysql://root@127.0.0.1:3306/bench_queue``, or ``--database sqlite`` for
``sqlite:////tmp/bench_queue/db.sqlite3`` (created and migrated when missing); the bench
works on its own queue and deletes its rows at the end. The plot of the drain rates goes to bench/queue.png.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# This file is named queue.py: with its folder on sys.path it would shadow the standard
# library's `queue`, which the worker and multiprocessing import. Keep the checkout only.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, databases, raw_connect, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb",
                        help="mariadb, sqlite, or a DATABASE_URL (default mariadb: " + databases("queue")["mariadb"] + ")")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (small counts, one repeat)")
    parser.add_argument("--drain-jobs", type=int, default=None, help="jobs per drain run at 2 processes x 16, fewer below (20000)")
    parser.add_argument("--concurrency", default="1,4,16", help="worker concurrencies (1,4,16)")
    parser.add_argument("--procs", default="1,2", help="worker process counts (1,2)")
    parser.add_argument("--repeat", type=int, default=None, help="raw/api runs per drain configuration (2)")
    parser.add_argument("--pickup-jobs", type=int, default=None, help="jobs of the pickup test (200)")
    parser.add_argument("--plot", default=str(_HERE / "queue.png"), help="where the PNG goes ('' for none)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("queue", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from leases.tasks import push, push_many  # noqa: E402
from leases.tasks import queue as jobqueue  # noqa: E402
from leases.tasks.models import Job, JobError, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402
from leases.tasks.registry import handler  # noqa: E402
from leases.tasks.worker import JobWorker  # noqa: E402

QUEUE = f"bench-{os.getpid()}"
NAME = "bench.noop"
POLL = 0.05  # the worker's default
TTL_US = 30_000_000


@handler(NAME, queue=QUEUE, max_attempts=1)
def noop(payload: Any) -> None:
    """Nothing: the drain measures the queue, not the work (inherited by forked children)."""
    return None


# -- raw SQL, per vendor --------------------------------------------------------------

COLUMNS = ("queue, name, backend, on_finish, limit_key, rate, payload, dedupe_key, pending_key, priority,"
           " max_attempts, run_at, status, attempt, claims, pushes, worker, enqueued_at, pool, target, affinity, turn")


def raw_sql(vendor: str) -> dict[str, str]:
    """The claim loop's statements, written out (the same shape as leases/tasks/sql.py)."""
    if vendor == "mysql":
        now, p, skip = "UTC_TIMESTAMP(6)", "%s", " FOR UPDATE SKIP LOCKED"
        later = "(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)"
        begin = "BEGIN"
    else:
        now, p, skip = "strftime('%Y-%m-%d %H:%M:%f000', 'now')", "?", ""
        later = "strftime('%Y-%m-%d %H:%M:%f000', 'now', ?)"
        begin = "BEGIN IMMEDIATE"
    return {
        "p": p,
        "begin": begin,
        "row": f"({p}, {p}, '', '', '', '', {p}, {p}, {p}, 0, 1, {later}, 0, 0, 0, 1, '', {now}, '', '', '', 0)",
        "insert": f"INSERT INTO leases_tasks_job ({COLUMNS}) VALUES ",
        "pick": (f"SELECT id, payload, attempt FROM leases_tasks_job WHERE status = 0 AND queue = {p}"
                 f" AND run_at <= {now} ORDER BY priority DESC, run_at, id LIMIT {p}{skip}"),
        "take": (f"UPDATE leases_tasks_job SET status = 1, attempt = attempt + 1, claims = claims + 1, worker = {p},"
                 f" pending_key = NULL, started_at = {now}, expires_at = {later} WHERE status = 0 AND id IN "),
        "done": (f"UPDATE leases_tasks_job SET status = 2, result = 'null', finished_at = {now},"
                 f" expires_at = NULL WHERE status = 1 AND id IN "),
    }


def delay_param(vendor: str, seconds: float) -> Any:
    return int(round(seconds * 1_000_000)) if vendor == "mysql" else f"{seconds:+.3f} seconds"


def vendor() -> str:
    return connections["default"].vendor


def raw_insert(cur: Any, sql: dict[str, str], start: int, count: int, delay: float = 0.0, per_row: bool = False) -> None:
    """`count` new jobs with distinct payloads: one multi-row INSERT, or one per job."""
    later = delay_param(vendor(), delay)
    rows = []
    for i in range(start, start + count):
        payload = json.dumps({"i": i})
        key = f"raw-{QUEUE}-{i}"
        rows.append((QUEUE, NAME, payload, key, key, later))
    if per_row:
        for row in rows:
            cur.execute(sql["insert"] + sql["row"], row)
        return
    for at in range(0, len(rows), 1000):
        chunk = rows[at : at + 1000]
        cur.execute(sql["insert"] + ", ".join([sql["row"]] * len(chunk)), [v for row in chunk for v in row])


def raw_claim(cur: Any, sql: dict[str, str], worker: str, limit: int) -> list[tuple]:
    """One claim transaction: pick `limit` ready rows and mark them running."""
    p = sql["p"]
    cur.execute(sql["begin"])
    try:
        cur.execute(sql["pick"], (QUEUE, limit))
        rows = cur.fetchall()
        if rows:
            cur.execute(sql["take"] + "(" + ", ".join([p] * len(rows)) + ")",
                        (worker, delay_param(vendor(), TTL_US / 1e6), *[r[0] for r in rows]))
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise
    return rows


def raw_done(cur: Any, sql: dict[str, str], ids: list[int]) -> None:
    cur.execute(sql["done"] + "(" + ", ".join([sql["p"]] * len(ids)) + ")", ids)


def purge() -> None:
    """Delete the bench queue's jobs, errors and worker rows."""
    JobError.objects.filter(job__queue=QUEUE).delete()
    conn = raw_connect()
    try:
        cur = conn.cursor()
        p = raw_sql(vendor())["p"]
        while True:  # in chunks, so no transaction grows large
            cur.execute(f"DELETE FROM leases_tasks_job WHERE queue = {p} LIMIT 5000" if vendor() == "mysql"
                        else f"DELETE FROM leases_tasks_job WHERE id IN (SELECT id FROM leases_tasks_job"
                             f" WHERE queue = {p} LIMIT 5000)", (QUEUE,))
            if cur.rowcount < 5000:
                break
    finally:
        conn.close()
    WorkerRow.objects.filter(queues=QUEUE).delete()


# -- enqueue -------------------------------------------------------------------------


def bench_enqueue(single: int, bulk: int) -> dict[str, float]:
    """Jobs per second of each way of writing jobs, one process, fresh rows each time."""
    sql = raw_sql(vendor())
    conn = raw_connect()
    cur = conn.cursor()
    out: dict[str, float] = {}
    offset = 0

    def timed(label: str, count: int, fn: Callable[[int], None]) -> None:
        nonlocal offset
        start = time.perf_counter()
        fn(offset)
        out[label] = count / (time.perf_counter() - start)
        offset += count
        purge()

    try:
        push(NAME, {"warm": 1})  # queue row, settings cache, connection
        purge()
        for order in (("raw", "api"), ("api", "raw")):  # ABBA
            for mode in order:
                if mode == "raw":
                    timed(f"raw_single_{order[0]}", single,
                          lambda o: raw_insert(cur, sql, o, single, per_row=True))
                    timed(f"raw_bulk_{order[0]}", bulk, lambda o: raw_insert(cur, sql, o, bulk))
                else:
                    timed(f"api_single_{order[0]}", single,
                          lambda o: [push(NAME, {"i": i}) for i in range(o, o + single)])
                    timed(f"api_bulk_{order[0]}", bulk,
                          lambda o: push_many((NAME, {"i": i}) for i in range(o, o + bulk)))
    finally:
        conn.close()
    result = {}
    for kind in ("single", "bulk"):
        for mode in ("raw", "api"):
            result[f"{mode}_{kind}"] = [out[f"{mode}_{kind}_raw"], out[f"{mode}_{kind}_api"]]
    return result


def bench_single_by_turns(count: int) -> dict[str, float]:
    """Microseconds of the median push() and of the median bare INSERT, `count` of each
    made by turns (the one first, then the other), each call timed on its own."""
    sql = raw_sql(vendor())
    conn = raw_connect()
    cur = conn.cursor()
    calls: dict[str, list[float]] = {"raw": [], "api": []}
    first = 10_000_000  # payloads and keys of their own
    try:
        for i in range(first, first + count):
            for mode in ("raw", "api") if i % 2 == 0 else ("api", "raw"):
                start = time.perf_counter()
                if mode == "raw":
                    raw_insert(cur, sql, i, 1, per_row=True)
                else:
                    push(NAME, {"i": i})
                calls[mode].append(time.perf_counter() - start)
    finally:
        conn.close()
        purge()
    return {mode: median(times) * 1e6 for mode, times in calls.items()}


# -- drain ---------------------------------------------------------------------------


def drain_child(mode: str, concurrency: int, barrier: Any, results: Any) -> None:
    """One process: drain the queue through the JobWorker, or through the raw loop."""
    try:
        if mode == "api":
            worker = JobWorker(queues=[QUEUE], concurrency=concurrency, burst=True, poll=POLL)
            worker.register()
            worker.active_queues()
            barrier.wait(timeout=60)
            stats = worker.run()
            done = stats.succeeded
        else:
            sql = raw_sql(vendor())
            conn = raw_connect()
            cur = conn.cursor()
            name = f"raw-{os.getpid()}"
            barrier.wait(timeout=60)
            done = 0
            while rows := raw_claim(cur, sql, name, concurrency):
                for _id, payload, _attempt in rows:  # what a worker does to start a job
                    json.loads(payload) if isinstance(payload, (str, bytes)) else payload
                raw_done(cur, sql, [r[0] for r in rows])
                done += len(rows)
            conn.close()
        results.put({"end": time.monotonic(), "done": done, "cpu": time.process_time()})
    except BaseException as exc:  # report instead of hanging the parent
        try:
            barrier.abort()
        except Exception:
            pass
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def preload(count: int) -> None:
    conn = raw_connect()
    try:
        raw_insert(conn.cursor(), raw_sql(vendor()), 0, count)
    finally:
        conn.close()


def drain_size(full: int, procs: int, concurrency: int) -> int:
    """`full` at 2 processes x 16 and fewer where the rate is lower, so each run takes
    about as long (a few seconds on the 2-core machine)."""
    share = {1: 0.15, 2: 0.25, 4: 0.4, 8: 0.7}.get(concurrency, 1.0) * (1.0 if procs >= 2 else 0.7)
    return max(500, int(full * share))


def drain_once(mode: str, procs: int, concurrency: int, jobs: int) -> dict[str, float]:
    purge()
    preload(jobs)
    connections.close_all()  # children must not share the parent's connection
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    children = [ctx.Process(target=drain_child, args=(mode, concurrency, barrier, results)) for _ in range(procs)]
    for child in children:
        child.start()
    barrier.wait(timeout=60)
    start = time.monotonic()
    got = [results.get(timeout=300) for _ in children]
    for child in children:
        child.join()
    errors = [r["error"] for r in got if "error" in r]
    if errors:
        raise SystemExit(f"{mode} drain, {procs} processes, concurrency {concurrency}: {errors[0]}")
    wall = max(r["end"] for r in got) - start
    finished = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    if finished != jobs:
        raise SystemExit(f"{mode} drain left {jobs - finished} of {jobs} jobs unfinished")
    return {"jobs_per_s": jobs / wall, "wall": wall,
            "cpu_us_per_job": sum(r["cpu"] for r in got) / jobs * 1e6}


# -- pickup latency ------------------------------------------------------------------


def pickup_child(mode: str, jobs: int, ready: Any) -> None:
    """An idle claimer at the default poll until it has started `jobs` jobs."""
    if mode == "api":
        worker = JobWorker(queues=[QUEUE], concurrency=4, poll=POLL, max_jobs=jobs)
        worker.register()
        ready.set()
        worker.run()
        return
    sql = raw_sql(vendor())
    conn = raw_connect()
    cur = conn.cursor()
    ready.set()
    done = 0
    while done < jobs:
        rows = raw_claim(cur, sql, f"raw-{os.getpid()}", 4)
        if rows:
            raw_done(cur, sql, [r[0] for r in rows])
            done += len(rows)
        else:
            time.sleep(POLL)
    conn.close()


def pickup_once(mode: str, jobs: int, delay: float) -> list[float]:
    """Milliseconds from each job's run_at to its started_at (both the server's clock)."""
    purge()
    connections.close_all()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=pickup_child, args=(mode, jobs, ready))
    child.start()
    ready.wait(timeout=60)
    time.sleep(0.3)  # let it settle into its idle poll
    conn = raw_connect()
    cur = conn.cursor()
    sql = raw_sql(vendor())
    # Pushes spaced by a pause that does not divide the poll, so run times fall all over it.
    for i in range(jobs):
        if mode == "api":
            push(NAME, {"i": i}, delay=delay)
        else:
            raw_insert(cur, sql, i, 1, delay=delay, per_row=True)
        time.sleep(0.0137)
    child.join(timeout=60 + jobs)
    conn.close()
    rows = Job.objects.filter(queue=QUEUE).values_list("run_at", "started_at")
    return [(started - run).total_seconds() * 1000 for run, started in rows if started is not None]


# -- report --------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    """(max - min) / median of the runs."""
    if len(values) < 2:
        return "-"
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for procs, color in ((1, "tab:blue"), (2, "tab:orange")):
        mine = sorted((r for r in rows if r["procs"] == procs), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        ax.plot(xs, [r["api"] for r in mine], "o-", color=color, label=f"JobWorker, {procs} process{'es' * (procs > 1)}")
        ax.plot(xs, [r["raw"] for r in mine], "s--", color=color, alpha=0.6,
                label=f"raw claim loop, {procs} process{'es' * (procs > 1)}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (worker threads; jobs per raw claim)")
    ax.set_ylabel("no-op jobs drained per second")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def prepare() -> None:
    """Migrate, refuse a database the raw statements are not written for, and make the
    bench's queue (its settings read afresh)."""
    call_command("migrate", verbosity=0, interactive=False)
    if vendor() not in ("mysql", "sqlite"):
        raise SystemExit("use a mysql:// or sqlite:/// DATABASE_URL")
    assert Job._meta.db_table == "leases_tasks_job", "the raw statements name the table"
    Queue.objects.get_or_create(name=QUEUE)
    jobqueue.forget_settings()


def print_enqueue(enq: dict[str, list[float]], single: int, bulk: int) -> None:
    """The enqueue table: raw beside api, one job and 1000 jobs per statement."""
    print(f"\nenqueue ({single} single, {bulk} bulk; raw then api, then api then raw)", flush=True)
    print(f"{'':<26} | {'raw jobs/s':>10} | {'api jobs/s':>10} | {'api/raw':>7} | raw spread | api spread")
    for kind, label in (("single", "one job per statement"), ("bulk", "1000 jobs per statement")):
        raw, api = enq[f"raw_{kind}"], enq[f"api_{kind}"]
        print(f"{label:<26} | {median(raw):>10,.0f} | {median(api):>10,.0f} | "
              f"{median(api) / median(raw):>7.2f} | {spread(raw):>10} | {spread(api):>10}", flush=True)


def drain_row(procs: int, concurrency: int, jobs: int, repeat: int) -> dict[str, Any]:
    """One drain configuration: `repeat` raw and api runs in ABBA order and their medians;
    prints the runs' rates as they end, since the whole drain takes minutes."""
    samples: dict[str, list[dict]] = {"raw": [], "api": []}
    for i in range(repeat):
        for mode in ("raw", "api") if i % 2 == 0 else ("api", "raw"):
            samples[mode].append(drain_once(mode, procs, concurrency, jobs))
    raw = [s["jobs_per_s"] for s in samples["raw"]]
    api = [s["jobs_per_s"] for s in samples["api"]]
    row = {"procs": procs, "concurrency": concurrency, "jobs": jobs, "raw": median(raw), "api": median(api),
           "raw_samples": raw, "api_samples": api,
           "raw_cpu_us": median([s["cpu_us_per_job"] for s in samples["raw"]]),
           "api_cpu_us": median([s["cpu_us_per_job"] for s in samples["api"]])}
    print(f"  {procs} proc x {concurrency:>2}: {jobs} jobs; raw {', '.join(f'{v:,.0f}' for v in raw)} | "
          f"api {', '.join(f'{v:,.0f}' for v in api)} jobs/s", flush=True)
    return row


def bench_drain(procs_list: list[int], concurrencies: list[int], drain_jobs: int, repeat: int) -> list[dict]:
    """A drain row per process count and concurrency, each on about as many seconds of jobs."""
    print(f"\ndrain: no-op jobs, median of {repeat} (ABBA); jobs per run scale with the concurrency", flush=True)
    rows = []
    for procs in procs_list:
        for conc in concurrencies:
            rows.append(drain_row(procs, conc, drain_size(drain_jobs, procs, conc), repeat))
    return rows


def print_drain(rows: list[dict], version: str) -> None:
    """The drain table: raw beside api per process count and concurrency, with the
    spreads of the runs and the client's CPU per job."""
    head = (f"{'procs x concurrency':<20} | {'raw jobs/s':>10} | {'api jobs/s':>10} | {'api/raw':>7} | "
            f"raw spread | api spread | raw cpu/job | api cpu/job")
    print(f"\ndrain, {version}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['procs']} x {r['concurrency']:<16} | {r['raw']:>10,.0f} | {r['api']:>10,.0f} | "
              f"{r['api'] / r['raw']:>7.2f} | {spread(r['raw_samples']):>10} | {spread(r['api_samples']):>10} | "
              f"{r['raw_cpu_us']:>8.0f} us | {r['api_cpu_us']:>8.0f} us")
    print("cpu/job: user + system time of the bench processes (not the server's) per job")


def print_pickup(pickups: dict[str, list[float]], jobs: int) -> None:
    """The pickup latencies' percentiles, raw then api."""
    print(f"\npickup latency (run_at -> started_at, server clock), {jobs} jobs pushed 0.2 s ahead, "
          f"poll {POLL} s")
    for mode in ("raw", "api"):
        ms = pickups[mode]
        print(f"  {mode}: p50 {percentile(ms, 50):.1f} ms, p95 {percentile(ms, 95):.1f} ms, "
              f"p99 {percentile(ms, 99):.1f} ms, max {max(ms):.1f} ms ({len(ms)} jobs)")


def print_goals(drain_rows: list[dict], enq: dict[str, list[float]], pickups: dict[str, list[float]]) -> None:
    """The project's performance goals, each met or MISSED by the API's numbers."""
    best2 = max((r["api"] for r in drain_rows if r["procs"] == 2), default=float("nan"))
    goals = [
        ("drain >= 2,500 jobs/s with 2 processes", best2 >= 2500, f"{best2:,.0f}"),
        ("bulk enqueue >= 20,000 jobs/s", median(enq["api_bulk"]) >= 20000, f"{median(enq['api_bulk']):,.0f}"),
        ("pickup p50 <= 30 ms", percentile(pickups["api"], 50) <= 30, f"{percentile(pickups['api'], 50):.1f} ms"),
        ("pickup p99 <= 100 ms", percentile(pickups["api"], 99) <= 100, f"{percentile(pickups['api'], 99):.1f} ms"),
    ]
    print("goals: " + "; ".join(f"{name}: {value} {'met' if ok else 'MISSED'}" for name, ok, value in goals))


def main() -> None:
    """Enqueue, drain and pickup, raw beside api; their tables, the goals, the plot and the JSON."""
    args = ARGS
    quick = args.quick
    drain_jobs = args.drain_jobs or (2000 if quick else 20000)
    repeat = args.repeat or (1 if quick else 2)
    pickup_jobs = args.pickup_jobs or (40 if quick else 200)
    single, bulk = (300, 5000) if quick else (2000, 20000)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    procs_list = [int(p) for p in args.procs.split(",")]

    prepare()
    version = database_version()
    cores = os.cpu_count()
    load = os.getloadavg()
    print(f"database: {version}; {cores} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"queue {QUEUE}", flush=True)
    started = time.monotonic()
    report: dict[str, Any] = {"database": version, "cores": cores, "load_at_start": load,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        enq = bench_enqueue(single, bulk)
        report["enqueue"] = enq
        print_enqueue(enq, single, bulk)
        turns = report["single_by_turns_us"] = bench_single_by_turns(single)
        print(f"one job per statement, by turns ({single} of each): median bare INSERT {turns['raw']:,.0f} us,"
              f" push() {turns['api']:,.0f} us, api/raw {turns['raw'] / turns['api']:.2f}", flush=True)
        drain_rows = bench_drain(procs_list, concurrencies, drain_jobs, repeat)
        report["drain"] = drain_rows
        pickups = {}
        for mode in ("raw", "api"):
            pickups[mode] = pickup_once(mode, pickup_jobs, 0.2)
        report["pickup_ms"] = pickups
    finally:
        purge()
        Queue.objects.filter(name=QUEUE).delete()
        connections.close_all()

    print_drain(drain_rows, version)
    print_pickup(pickups, pickup_jobs)
    load_end = os.getloadavg()
    print(f"\nload average {load[0]:.2f} at start, {load_end[0]:.2f} at end (counts the bench's own processes); "
          f"{time.monotonic() - started:.0f} s in all")
    print_goals(drain_rows, enq, pickups)
    if args.plot and drain_rows:
        plot(drain_rows, Path(args.plot), f"{version.split(',')[0]}, {cores} cores, {report['date']}")
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
