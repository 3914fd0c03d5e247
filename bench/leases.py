"""Acquire+release pairs per second: the public API beside the same protocol in raw SQL.

    python bench/leases.py [--seconds 5] [--procs 1,4,8] [--repeat 2] [--json out.json]

Each configuration forks N processes (each opens its own connection), lets them warm up,
then runs them together for a fixed time. A pair is one acquisition and its release:

* api: ``Pool(name).acquire(ttl=60)`` then ``lease.release()`` through Django;
* raw: the protocol's three statements (candidates SELECT, conditional claim UPDATE on
  the token read, trying the next candidate when it loses, release UPDATE by
  id/token/holder) on a raw DB-API connection: MySQLdb with FOUND_ROWS and autocommit,
  or sqlite3 with the project's busy timeout and WAL.

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

from leases import NoResourceAvailable, Pool  # noqa: E402
from leases.models import EPOCH, Resource  # noqa: E402

TTL = 60
#: Same values as the engine's leases.pool.CANDIDATES and ROUNDS.
CANDIDATES = 5
ROUNDS = 3
#: Pool size of the main runs: 8 processes rarely pick the same row out of 64.
BIG_POOL = 64
#: Contended case: 8 processes on 4 resources, waiting up to WAIT seconds.
SMALL_POOL, CONTENDED_PROCS, WAIT = 4, 8, 5.0

# The protocol's statements written out per vendor (same shape as leases/sql.py).
RAW_SQL = {
    "mysql": {
        "candidates": (
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

    def __init__(self, pool: str, wait: float) -> None:
        self.vendor = vendor()
        self.sql = RAW_SQL[self.vendor]
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
            cur.execute(sql["candidates"], (self.pool, CANDIDATES))
            rows = cur.fetchall()
            if not rows:
                return None
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
        loop = (RawLoop if mode == "raw" else ApiLoop)(pool, wait)
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
    """Every resource of the bench pool free again (a run may have been interrupted)."""
    Resource.objects.filter(pool=pool).update(busy_before=EPOCH, holder="")


def still_held(pool: str) -> int:
    from leases.pool import db_now

    return Resource.objects.filter(pool=pool, busy_before__gt=db_now()).count()


def database_version() -> str:
    conn = connections["default"]
    if conn.vendor == "sqlite":
        import sqlite3

        return f"SQLite {sqlite3.sqlite_version}"
    with conn.cursor() as cur:
        cur.execute("SELECT VERSION()")
        version = cur.fetchone()[0]
    return f"{'MariaDB' if conn.mysql_is_mariadb else 'MySQL'} {version}"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per run (5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up per run (0.5)")
    parser.add_argument("--procs", default="1,4,8", help="process counts (1,4,8)")
    parser.add_argument("--repeat", type=int, default=2, help="raw/api runs per configuration (2)")
    parser.add_argument("--no-contended", action="store_true",
                        help=f"skip the contended case ({CONTENDED_PROCS} processes, pool of {SMALL_POOL})")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    procs_list = [int(p) for p in args.procs.split(",") if p.strip()]
    if not procs_list or min(procs_list) < 1 or args.repeat < 1 or args.seconds <= 0:
        parser.error("need --procs >= 1, --repeat >= 1 and --seconds > 0")

    call_command("migrate", verbosity=0, interactive=False)
    vendor_ = vendor()
    if vendor_ not in RAW_SQL:
        raise SystemExit(f"no raw SQL for {vendor_!r}: use a mysql:// or sqlite:/// DATABASE_URL")
    assert Resource._meta.db_table == "leases_resource", "the raw statements name the table"

    tag = f"bench-{os.getpid()}-{secrets.token_hex(3)}"
    big, small = f"{tag}-{BIG_POOL}", f"{tag}-{SMALL_POOL}"
    Pool(big).add_many((f"r{i:03d}", {"n": i}) for i in range(BIG_POOL))
    Pool(small).add_many((f"r{i:03d}", {"n": i}) for i in range(SMALL_POOL))
    version = database_version()
    policy = commit_policy()
    cores = os.cpu_count()

    configs = [(p, big, 0.0) for p in procs_list]
    if not args.no_contended:
        configs.append((CONTENDED_PROCS, small, WAIT))

    print(f"database: {version} ({vendor_}), {policy}; pools {big} and {small}", flush=True)
    sharing = "with each other" if vendor_ == "sqlite" else "with each other and the database server"
    load_start = os.getloadavg()[0]
    busy = busy_cores()
    busy_text = f"{busy:.1f} cores busy over 1 s before the first run, " if busy is not None else ""
    print(f"machine: {cores} cores, so runs with more processes than cores share the CPU {sharing}; "
          f"{busy_text}load average {load_start:.2f} (other jobs skew results)", flush=True)
    print(f"each run: {args.warmup:g}s warm-up, {args.seconds:g}s measured; "
          f"raw and api interleaved (ABBA), median of {args.repeat}", flush=True)

    rows = []
    try:
        for procs, pool, wait in configs:
            samples: dict[str, list[dict]] = {"raw": [], "api": []}
            for i in range(args.repeat):
                # ABBA: raw, api, api, raw, ... so a steady drift of the load cancels out
                for mode in ("raw", "api") if i % 2 == 0 else ("api", "raw"):
                    samples[mode].append(run_once(mode, pool, procs, wait, args.warmup, args.seconds))
            raw = [s["pairs_per_s"] for s in samples["raw"]]
            api = [s["pairs_per_s"] for s in samples["api"]]
            raw_cpu = [s["cpu_us_per_pair"] for s in samples["raw"]]
            api_cpu = [s["cpu_us_per_pair"] for s in samples["api"]]
            label = f"{procs}" if pool == big else f"{procs} (pool {SMALL_POOL}, wait {wait:g}s)"
            row = {
                "procs": procs,
                "pool_size": BIG_POOL if pool == big else SMALL_POOL,
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
            rows.append(row)
            print(f"  {label}: raw {', '.join(f'{v:.0f}' for v in raw)} | "
                  f"api {', '.join(f'{v:.0f}' for v in api)} pairs/s; client cpu/pair "
                  f"raw {', '.join(f'{v:.0f}' for v in raw_cpu)} | "
                  f"api {', '.join(f'{v:.0f}' for v in api_cpu)} us", flush=True)
        leftover = still_held(big) + still_held(small)
    finally:
        deleted, _ = Resource.objects.filter(pool__in=[big, small]).delete()
        connections.close_all()

    head = (f"{'procs':<24} | {'raw pairs/s':>11} | {'api pairs/s':>11} | {'api/raw':>7} | "
            f"raw spread | api spread | raw cpu/pair | api cpu/pair")
    print()
    print(f"{version}, {policy}; {cores} cores, {args.seconds:g}s per run, median of {args.repeat}")
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
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (that one counts the "
          f"bench's own processes); {leftover} resources left held; {deleted} bench rows deleted")
    if cores and (busy if busy is not None else load_start) > cores / 4:
        print(f"note: other jobs were using the machine before the first run ({busy_text}load average "
              f"{load_start:.2f} on {cores} cores): compare the spreads, and prefer more --repeat on a "
              "quiet machine")

    if args.json:
        out = {
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


if __name__ == "__main__":
    main()
