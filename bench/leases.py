"""Acquire+release pairs per second: the public API beside the same protocol in raw SQL,
and how both scale with the pool's size.

    python bench/leases.py [--seconds 5] [--procs 1,4,8] [--repeat 2] [--sizes 40,10000,1000000]
                           [--plot bench/leases.png] [--json out.json]

Each configuration forks N processes (each opens its own connection), lets them warm up,
then runs them together for a fixed time. A pair is one acquisition and its release:

* api: ``Pool(name).acquire(ttl=60)`` then ``lease.release()`` through Django;
* raw: the protocol's three statements (candidates SELECT of the few rows free longest,
  tried in random order; conditional claim UPDATE on the token read, trying the next
  candidate when it loses; release UPDATE by id/token/holder) on a raw DB-API
  connection: MySQLdb with FOUND_ROWS and autocommit, or sqlite3 with the project's busy
  timeout and WAL;
* old (pool-size axis only): the raw loop with the first design's candidates, every free
  row sorted by RAND(), beside the others at the sizes where it finishes.

The pool-size axis (`--sizes`) runs api and raw with 1 and 8 processes on pools of each
size (and old up to OLD_MAX rows), and plots pairs/s against the size (`--plot`).

Raw and api runs alternate in an ABBA order (raw, api, api, raw, ...) so both see the
same machine state and a drift in the background load favours neither; the table reports
the median of `--repeat` runs of each, and the client CPU time per pair (user + system
time of the bench processes over the measured window, median of the runs): on a busy
machine that number moves much less than the pairs per second.

The database is DATABASE_URL, as for the project; the bench migrates it, works on its
own pools (``bench-...``) and deletes their rows at the end.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import secrets
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The script's own folder comes first on sys.path, and this file is named leases.py:
# drop that folder so that `import leases` finds the app, and put the checkout first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from bench.benchdb import database_version  # noqa: E402
from leases import NoResourceAvailable, Pool  # noqa: E402
from leases.models import EPOCH, Resource  # noqa: E402

TTL = 60
#: Same values as the engine's leases.pool.CANDIDATES and ROUNDS.
CANDIDATES = 8
ROUNDS = 3
#: The largest pool the old design (every free row sorted by RAND()) is run on: at a
#: million rows one of its pairs takes seconds.
OLD_MAX = 10_000
#: Process counts of the pool-size axis.
SIZE_PROCS = (1, 8)
#: Pool size of the main runs: 8 processes rarely pick the same row out of 64.
BIG_POOL = 64
#: Contended case: 8 processes on 4 resources, waiting up to WAIT seconds.
SMALL_POOL, CONTENDED_PROCS, WAIT = 4, 8, 5.0

# The protocol's statements written out per vendor (same shape as leases/sql.py).
RAW_SQL = {
    "mysql": {
        "candidates": (
            "SELECT id, token, name, data, UTC_TIMESTAMP(6) FROM `leases_resource`"
            " WHERE pool = %s AND busy_before <= UTC_TIMESTAMP(6) ORDER BY busy_before LIMIT %s"
        ),
        "candidates_old": (
            "SELECT id, token, name, data, UTC_TIMESTAMP(6) FROM `leases_resource`"
            " WHERE pool = %s AND busy_before <= UTC_TIMESTAMP(6) ORDER BY RAND() LIMIT %s"
        ),
        "claim": (
            "UPDATE `leases_resource` SET"
            " busy_before = (UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND), holder = %s,"
            " token = token + 1, acquired_at = UTC_TIMESTAMP(6), renewed_at = UTC_TIMESTAMP(6),"
            " quarantined_until = NULL, quarantine_reason = ''"
            " WHERE id = %s AND token = %s AND busy_before <= UTC_TIMESTAMP(6)"
        ),
        "release": (
            "UPDATE `leases_resource` SET busy_before = UTC_TIMESTAMP(6), holder = ''"
            " WHERE id = %s AND token = %s AND holder = %s"
        ),
    },
    "sqlite": {
        "candidates": (
            "SELECT id, token, name, data, strftime('%Y-%m-%d %H:%M:%f000', 'now')"
            ' FROM "leases_resource"'
            " WHERE pool = ? AND busy_before <= strftime('%Y-%m-%d %H:%M:%f000', 'now')"
            " ORDER BY busy_before LIMIT ?"
        ),
        "candidates_old": (
            "SELECT id, token, name, data, strftime('%Y-%m-%d %H:%M:%f000', 'now')"
            ' FROM "leases_resource"'
            " WHERE pool = ? AND busy_before <= strftime('%Y-%m-%d %H:%M:%f000', 'now')"
            " ORDER BY RANDOM() LIMIT ?"
        ),
        "claim": (
            'UPDATE "leases_resource" SET'
            " busy_before = strftime('%Y-%m-%d %H:%M:%f000', 'now', ?), holder = ?,"
            " token = token + 1, acquired_at = strftime('%Y-%m-%d %H:%M:%f000', 'now'),"
            " renewed_at = strftime('%Y-%m-%d %H:%M:%f000', 'now'),"
            " quarantined_until = NULL, quarantine_reason = ''"
            " WHERE id = ? AND token = ?"
            " AND busy_before <= strftime('%Y-%m-%d %H:%M:%f000', 'now')"
        ),
        "release": (
            "UPDATE \"leases_resource\" SET busy_before = strftime('%Y-%m-%d %H:%M:%f000', 'now'),"
            " holder = '' WHERE id = ? AND token = ? AND holder = ?"
        ),
    },
}


def vendor() -> str:
    return connections["default"].vendor


def ttl_param(vendor_: str, seconds: float):
    """The parameter of the `later` fragment, as leases.db's dialects build it."""
    return int(round(seconds * 1_000_000)) if vendor_ == "mysql" else f"{seconds:+.3f} seconds"


def raw_connect(vendor_: str):
    """A DB-API connection to the database Django uses, set up like Django sets up its own."""
    cfg = settings.DATABASES["default"]
    if vendor_ == "mysql":
        import MySQLdb
        from MySQLdb.constants import CLIENT

        kwargs = {"db": cfg["NAME"], "user": cfg["USER"], "charset": "utf8mb4"}
        if cfg.get("PASSWORD"):
            kwargs["password"] = cfg["PASSWORD"]
        host = cfg.get("HOST") or ""
        if host.startswith("/"):
            kwargs["unix_socket"] = host
        elif host:
            kwargs["host"] = host
        if cfg.get("PORT"):
            kwargs["port"] = int(cfg["PORT"])
        options = dict(cfg.get("OPTIONS", {}))
        isolation = options.pop("isolation_level", "read committed")
        kwargs.update(options)
        kwargs.update(client_flag=CLIENT.FOUND_ROWS, autocommit=True)
        conn = MySQLdb.connect(**kwargs)
        if isolation:  # Django's default for its connections
            cur = conn.cursor()
            cur.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation.upper()}")
            cur.close()
        return conn
    import sqlite3

    options = dict(cfg.get("OPTIONS", {}))
    conn = sqlite3.connect(cfg["NAME"], timeout=options.get("timeout", 5), isolation_level=None)
    for command in options.get("init_command", "").split(";"):
        if command.strip():
            conn.execute(command)
    return conn


# -- the two loops, each run in a forked child ---------------------------------------


class RawLoop:
    """The protocol on a raw connection: candidates, claim (next candidate on a loss), release."""

    def __init__(self, pool: str, wait: float, old: bool = False) -> None:
        self.vendor = vendor()
        self.sql = RAW_SQL[self.vendor]
        self.candidates = self.sql["candidates_old" if old else "candidates"]
        self.conn = raw_connect(self.vendor)
        self.cursor = self.conn.cursor()
        self.pool = pool
        self.wait = wait
        self.later = ttl_param(self.vendor, TTL)
        self.prefix = f"{socket.gethostname()}:{os.getpid()}"
        self.lost = 0  # claims that lost the race
        self.timeouts = 0

    def _try(self, holder: str):
        cur, sql = self.cursor, self.sql
        for _ in range(ROUNDS):
            cur.execute(self.candidates, (self.pool, CANDIDATES))
            rows = list(cur.fetchall())
            if not rows:
                return None
            random.shuffle(rows)
            for id_, token, _name, _data, _now in rows:
                cur.execute(sql["claim"], (self.later, holder, id_, token))
                if cur.rowcount == 1:
                    return id_, token + 1
                self.lost += 1
        return None

    def pair(self) -> bool:
        holder = f"{self.prefix}:{secrets.token_hex(4)}"  # one per acquisition, as the engine
        deadline = time.monotonic() + self.wait
        attempt = 0
        while True:
            got = self._try(holder)
            if got is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                return False
            # the engine's pause between attempts: 50 ms + full-jitter backoff
            time.sleep(min(left, 0.05 + random.uniform(0, min(1.0, 0.05 * 2**attempt))))
            attempt += 1
        id_, token = got
        self.cursor.execute(self.sql["release"], (id_, token, holder))
        return self.cursor.rowcount == 1

    def close(self) -> None:
        self.cursor.close()
        self.conn.close()


class ApiLoop:
    """The public API: Pool(name).acquire(ttl=60[, wait]) then lease.release()."""

    def __init__(self, pool: str, wait: float) -> None:
        self.pool = pool
        self.wait = wait
        self.lost = None  # not visible through the API
        self.timeouts = 0

    def pair(self) -> bool:
        try:
            lease = Pool(self.pool).acquire(ttl=TTL, wait=self.wait)
        except NoResourceAvailable:
            self.timeouts += 1
            return False
        return lease.release()

    def close(self) -> None:
        connections.close_all()


def child(mode: str, pool: str, wait: float, warmup: float, seconds: float, barrier, queue) -> None:
    try:
        loop = ApiLoop(pool, wait) if mode == "api" else RawLoop(pool, wait, old=mode == "old")
        end = time.monotonic() + warmup
        while time.monotonic() < end:
            loop.pair()
        loop.lost = 0 if loop.lost is not None else None
        loop.timeouts = 0
        barrier.wait(timeout=120)
        pairs = failed = 0
        cpu_start = time.process_time()
        start = time.monotonic()
        end = start + seconds
        now = start
        while now < end:
            if loop.pair():
                pairs += 1
            else:
                failed += 1
            now = time.monotonic()
        elapsed = now - start
        cpu = time.process_time() - cpu_start
        loop.close()
        queue.put({"pairs": pairs, "failed": failed, "elapsed": elapsed, "cpu": cpu,
                   "lost": loop.lost, "timeouts": loop.timeouts})
    except BaseException as exc:  # report instead of hanging the parent
        try:
            barrier.abort()
        except Exception:
            pass
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run_once(mode: str, pool: str, procs: int, wait: float, warmup: float, seconds: float) -> dict:
    """One configuration: `procs` forked children together; total pairs per second."""
    reset(pool)
    connections.close_all()  # children must not share the parent's connection
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs)
    queue = ctx.Queue()
    children = [
        ctx.Process(target=child, args=(mode, pool, wait, warmup, seconds, barrier, queue))
        for _ in range(procs)
    ]
    for p in children:
        p.start()
    results = [queue.get(timeout=warmup + seconds + 180) for _ in children]
    for p in children:
        p.join()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{mode} run with {procs} processes failed: {errors[0]}")
    lost = [r["lost"] for r in results]
    pairs = sum(r["pairs"] for r in results)
    return {
        "pairs_per_s": sum(r["pairs"] / r["elapsed"] for r in results),
        "pairs": pairs,
        "cpu_us_per_pair": sum(r["cpu"] for r in results) / pairs * 1e6 if pairs else float("nan"),
        "failed": sum(r["failed"] for r in results),
        "timeouts": sum(r["timeouts"] for r in results),
        "lost_claims": None if None in lost else sum(lost),
    }


# -- set-up and clean-up in the parent -------------------------------------------------


def reset(pool: str) -> None:
    """Every resource of the bench pool free again (a run may have been interrupted);
    only the rows ever used are touched, through the (pool, busy_before) index."""
    Resource.objects.filter(pool=pool, busy_before__gt=EPOCH).update(busy_before=EPOCH, holder="")


def still_held(pool: str) -> int:
    from leases.clock import db_now

    return Resource.objects.filter(pool=pool, busy_before__gt=db_now()).count()


def commit_policy() -> str:
    """What a commit waits for: with a flush per commit, one process is bound by the disk."""
    conn = connections["default"]
    if conn.vendor == "sqlite":
        with conn.cursor() as cur:
            cur.execute("PRAGMA journal_mode")
            mode = cur.fetchone()[0]
            cur.execute("PRAGMA synchronous")
            sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(cur.fetchone()[0], "?")
        return f"journal_mode={mode}, synchronous={sync}"
    with conn.cursor() as cur:
        cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
        flush = cur.fetchone()[0]
    meaning = {0: "no log flush at commit", 1: "a log flush to disk per commit",
               2: "log written, not flushed, per commit"}.get(int(flush), "")
    return f"innodb_flush_log_at_trx_commit={flush} ({meaning})"


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores' worth of CPU the whole machine used over `seconds` (Linux /proc/stat), or None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return sum(ticks[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (total - (idle1 - idle0)) / total * (os.cpu_count() or 1) if total > 0 else None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    """Relative range of the samples: (max - min) / median."""
    if len(values) < 2:
        return "-"
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"


def parse_args() -> tuple[argparse.Namespace, list[int]]:
    """The options, and the process counts of the main runs (checked here, so a typo
    fails before the bench fills any table)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per run (5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up per run (0.5)")
    parser.add_argument("--procs", default="1,4,8", help="process counts (1,4,8)")
    parser.add_argument("--repeat", type=int, default=2, help="raw/api runs per configuration (2)")
    parser.add_argument("--no-contended", action="store_true",
                        help=f"skip the contended case ({CONTENDED_PROCS} processes, pool of {SMALL_POOL})")
    parser.add_argument("--sizes", default="40,10000,1000000",
                        help="pool sizes of the size axis, '' for none (40,10000,1000000)")
    parser.add_argument("--plot", default=str(_HERE / "leases.png"), help="the size axis's PNG ('' for none)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    procs_list = [int(p) for p in args.procs.split(",") if p.strip()]
    if not procs_list or min(procs_list) < 1 or args.repeat < 1 or args.seconds <= 0:
        parser.error("need --procs >= 1, --repeat >= 1 and --seconds > 0")
    return args, procs_list


def check_database() -> str:
    """Migrate, and refuse a database the raw statements are not written for; the vendor."""
    call_command("migrate", verbosity=0, interactive=False)
    vendor_ = vendor()
    if vendor_ not in RAW_SQL:
        raise SystemExit(f"no raw SQL for {vendor_!r}: use a mysql:// or sqlite:/// DATABASE_URL")
    assert Resource._meta.db_table == "leases_resource", "the raw statements name the table"
    return vendor_


def make_pools() -> tuple[str, str]:
    """The main runs' pools (BIG_POOL and SMALL_POOL resources), named for this run so
    that they never meet another bench's rows."""
    tag = f"bench-{os.getpid()}-{secrets.token_hex(3)}"
    big, small = f"{tag}-{BIG_POOL}", f"{tag}-{SMALL_POOL}"
    Pool(big).add_many((f"r{i:03d}", {"n": i}) for i in range(BIG_POOL))
    Pool(small).add_many((f"r{i:03d}", {"n": i}) for i in range(SMALL_POOL))
    return big, small


def busy_text(busy: float | None) -> str:
    """The CPU other jobs used before the first run, as the reports put it ('' if unknown)."""
    return f"{busy:.1f} cores busy over 1 s before the first run, " if busy is not None else ""


def print_machine(vendor_: str, cores: int | None, args: argparse.Namespace) -> tuple[float, float | None]:
    """Print the machine's state and the runs' settings; returns the load average and the
    busy cores measured before the first run, which the end of the report compares."""
    sharing = "with each other" if vendor_ == "sqlite" else "with each other and the database server"
    load_start = os.getloadavg()[0]
    busy = busy_cores()
    print(f"machine: {cores} cores, so runs with more processes than cores share the CPU {sharing}; "
          f"{busy_text(busy)}load average {load_start:.2f} (other jobs skew results)", flush=True)
    print(f"each run: {args.warmup:g}s warm-up, {args.seconds:g}s measured; "
          f"raw and api interleaved (ABBA), median of {args.repeat}", flush=True)
    return load_start, busy


def measure(procs: int, pool: str, wait: float, contended: bool, args: argparse.Namespace) -> dict:
    """One configuration's row: `--repeat` raw and api runs in ABBA order and their medians;
    prints every run's rate as it goes, since a full bench takes minutes."""
    samples: dict[str, list[dict]] = {"raw": [], "api": []}
    for i in range(args.repeat):
        # ABBA: raw, api, api, raw, ... so a steady drift of the load cancels out
        for mode in ("raw", "api") if i % 2 == 0 else ("api", "raw"):
            samples[mode].append(run_once(mode, pool, procs, wait, args.warmup, args.seconds))
    raw = [s["pairs_per_s"] for s in samples["raw"]]
    api = [s["pairs_per_s"] for s in samples["api"]]
    raw_cpu = [s["cpu_us_per_pair"] for s in samples["raw"]]
    api_cpu = [s["cpu_us_per_pair"] for s in samples["api"]]
    label = f"{procs} (pool {SMALL_POOL}, wait {wait:g}s)" if contended else f"{procs}"
    row = {
        "procs": procs,
        "pool_size": SMALL_POOL if contended else BIG_POOL,
        "wait": wait,
        "label": label,
        "raw_pairs_per_s": median(raw),
        "api_pairs_per_s": median(api),
        "ratio": median(api) / median(raw) if median(raw) else float("nan"),
        "raw_cpu_us_per_pair": median(raw_cpu),
        "api_cpu_us_per_pair": median(api_cpu),
        "raw_samples": raw,
        "api_samples": api,
        "raw_runs": samples["raw"],
        "api_runs": samples["api"],
    }
    print(f"  {label}: raw {', '.join(f'{v:.0f}' for v in raw)} | "
          f"api {', '.join(f'{v:.0f}' for v in api)} pairs/s; client cpu/pair "
          f"raw {', '.join(f'{v:.0f}' for v in raw_cpu)} | "
          f"api {', '.join(f'{v:.0f}' for v in api_cpu)} us", flush=True)
    return row


def print_table(rows: list[dict], title: str) -> None:
    """The main runs' table, then what went wrong in them: acquisitions that found no free
    resource, and claims that lost a race (raw only: the API does not show them)."""
    head = (f"{'procs':<24} | {'raw pairs/s':>11} | {'api pairs/s':>11} | {'api/raw':>7} | "
            f"raw spread | api spread | raw cpu/pair | api cpu/pair")
    print()
    print(title)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['label']:<24} | {r['raw_pairs_per_s']:>11.0f} | {r['api_pairs_per_s']:>11.0f} | "
              f"{r['ratio']:>7.2f} | {spread(r['raw_samples']):>10} | {spread(r['api_samples']):>10} | "
              f"{r['raw_cpu_us_per_pair']:>9.0f} us | {r['api_cpu_us_per_pair']:>9.0f} us")
    print("spread: (max - min) / median of the runs; cpu/pair: user + system time of the bench "
          "processes per pair (the database server's time is not included)")
    for r in rows:
        extra = []
        for mode in ("raw", "api"):
            failed = sum(s["failed"] for s in r[f"{mode}_runs"])
            lost = [s["lost_claims"] for s in r[f"{mode}_runs"]]
            if failed:
                extra.append(f"{mode}: {failed} acquisitions found no free resource")
            if None not in lost and sum(lost):
                extra.append(f"{mode}: {sum(lost)} claims lost a race")
        if extra:
            print(f"  {r['label']}: " + "; ".join(extra))


def print_load(load_start: float, busy: float | None, cores: int | None, leftover: int, deleted: int) -> None:
    """The load before and after and the clean-up; a note when other jobs were busy
    before the first run, whose results then say less."""
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (that one counts the "
          f"bench's own processes); {leftover} resources left held; {deleted} bench rows deleted")
    if cores and (busy if busy is not None else load_start) > cores / 4:
        print(f"note: other jobs were using the machine before the first run ({busy_text(busy)}load average "
              f"{load_start:.2f} on {cores} cores): compare the spreads, and prefer more --repeat on a "
              "quiet machine")


def main() -> None:
    """The main runs, then the pool-size axis; their tables, the plot and the JSON."""
    args, procs_list = parse_args()
    vendor_ = check_database()
    big, small = make_pools()
    version = database_version(flush=False)
    policy = commit_policy()
    cores = os.cpu_count()

    configs = [(p, big, 0.0) for p in procs_list]
    if not args.no_contended:
        configs.append((CONTENDED_PROCS, small, WAIT))

    print(f"database: {version} ({vendor_}), {policy}; pools {big} and {small}", flush=True)
    load_start, busy = print_machine(vendor_, cores, args)

    try:
        rows = [measure(procs, pool, wait, pool != big, args) for procs, pool, wait in configs]
        leftover = still_held(big) + still_held(small)
    finally:
        deleted, _ = Resource.objects.filter(pool__in=[big, small]).delete()
        connections.close_all()

    print_table(rows, f"{version}, {policy}; {cores} cores, {args.seconds:g}s per run, median of {args.repeat}")
    print_load(load_start, busy, cores, leftover, deleted)

    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    axis = size_axis(sizes, args) if sizes else []
    if axis and args.plot:
        plot(axis, Path(args.plot), f"{version}, {cores} cores, {time.strftime('%Y-%m-%d')}")

    if args.json:
        out = {
            "size_axis": axis,
            "database": version,
            "vendor": vendor_,
            "cores": cores,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "commit_policy": policy,
            "load_average_at_start": load_start,
            "busy_cores_at_start": busy,
            "results": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def size_axis(sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Pairs/s of api, raw and (on small pools) old against the pool's size."""
    rows = []
    print(f"\npool-size axis: {', '.join(f'{n:,}' for n in sizes)} resources; {', '.join(map(str, SIZE_PROCS))}"
          f" processes; {args.seconds:g}s per run, median of {args.repeat}", flush=True)
    for size in sizes:
        pool = f"bench-size-{os.getpid()}-{size}"
        began = time.monotonic()
        Pool(pool).add_many(((f"r{i:07d}", None) for i in range(size)), batch_size=5000)
        print(f"  {size:,} resources made in {time.monotonic() - began:.1f}s", flush=True)
        try:
            for procs in SIZE_PROCS:
                modes = ["raw", "api"] + (["old"] if size <= OLD_MAX else [])
                samples: dict[str, list[float]] = {mode: [] for mode in modes}
                for i in range(args.repeat):
                    for mode in modes if i % 2 == 0 else modes[::-1]:
                        run = run_once(mode, pool, procs, 0.0, args.warmup, args.seconds)
                        samples[mode].append(run["pairs_per_s"])
                row = {"size": size, "procs": procs, **{mode: median(v) for mode, v in samples.items()}}
                rows.append(row)
                print(f"  {size:>9,} resources, {procs} process(es): "
                      + ", ".join(f"{mode} {row[mode]:,.0f}" for mode in modes) + " pairs/s", flush=True)
        finally:
            began = time.monotonic()
            deleted, _ = Resource.objects.filter(pool=pool).delete()
            print(f"  {deleted:,} rows deleted in {time.monotonic() - began:.1f}s", flush=True)
    print(f"\n{'resources':>10} | {'procs':>5} | {'api pairs/s':>11} | {'raw pairs/s':>11} | {'old pairs/s':>11} | "
          f"api vs smallest")
    for row in rows:
        first = next(r for r in rows if r["procs"] == row["procs"])
        old = f"{row['old']:>11,.0f}" if "old" in row else f"{'-':>11}"
        print(f"{row['size']:>10,} | {row['procs']:>5} | {row['api']:>11,.0f} | {row['raw']:>11,.0f} | {old} | "
              f"{first['api'] / row['api']:.2f}x the cost")
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Pairs/s against pool size, log-log, one line per mode and process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"api": "o-", "raw": "s--", "old": "x:"}
    for procs, colour in zip(SIZE_PROCS, ("tab:blue", "tab:orange")):
        for mode, style in styles.items():
            mine = [r for r in rows if r["procs"] == procs and mode in r]
            if mine:
                ax.plot([r["size"] for r in mine], [r[mode] for r in mine], style, color=colour,
                        label=f"{mode}, {procs} process{'es' * (procs > 1)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("resources in the pool")
    ax.set_ylabel("acquire+release pairs per second")
    ax.set_title(f"Acquire cost against pool size\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
