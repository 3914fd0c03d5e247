"""The two loops bench/leases.py measures, each run in forked children: the public API's
acquire+release pairs, and the same protocol's statements on a raw DB-API connection
(and the first design's RAND() candidates, for the pool-size axis). Imported by
bench/leases.py after it has set Django up.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import secrets
import socket
import time

from django.conf import settings
from django.db import connections

from leases import NoResourceAvailable, Pool
from leases.models import EPOCH, Resource

TTL = 60
#: Same values as the engine's leases.pool.CANDIDATES and ROUNDS.
CANDIDATES = 8
ROUNDS = 3

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
    "postgresql": {
        "candidates": (
            "SELECT id, token, name, data, statement_timestamp() FROM \"leases_resource\""
            " WHERE pool = %s AND busy_before <= statement_timestamp() ORDER BY busy_before LIMIT %s"
        ),
        "candidates_old": (
            "SELECT id, token, name, data, statement_timestamp() FROM \"leases_resource\""
            " WHERE pool = %s AND busy_before <= statement_timestamp() ORDER BY random() LIMIT %s"
        ),
        "claim": (
            "UPDATE \"leases_resource\" SET"
            " busy_before = (statement_timestamp() + %s * INTERVAL '1 microsecond'), holder = %s,"
            " token = token + 1, acquired_at = statement_timestamp(), renewed_at = statement_timestamp(),"
            " quarantined_until = NULL, quarantine_reason = ''"
            " WHERE id = %s AND token = %s AND busy_before <= statement_timestamp()"
        ),
        "release": (
            "UPDATE \"leases_resource\" SET busy_before = statement_timestamp(), holder = ''"
            " WHERE id = %s AND token = %s AND holder = %s"
        ),
    },
}


def vendor() -> str:
    return connections["default"].vendor


def ttl_param(vendor_: str, seconds: float):
    """The parameter of the `later` fragment, as leases.db's dialects build it."""
    return f"{seconds:+.3f} seconds" if vendor_ == "sqlite" else int(round(seconds * 1_000_000))


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
    if vendor_ == "postgresql":
        import psycopg

        return psycopg.connect(dbname=cfg["NAME"], user=cfg["USER"], password=cfg.get("PASSWORD") or None,
                               host=cfg.get("HOST") or None, port=cfg.get("PORT") or None, autocommit=True)
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


def reset(pool: str) -> None:
    """Every resource of the bench pool free again (a run may have been interrupted);
    only the rows ever used are touched, through the (pool, busy_before) index."""
    Resource.objects.filter(pool=pool, busy_before__gt=EPOCH).update(busy_before=EPOCH, holder="")


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
