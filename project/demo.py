"""`make demo`: crawler processes share a pool of proxies through django-leases.

    python -m project.demo [--proxies 40] [--crawlers 60] [--kills 5] [--seconds 30] [--ttl 3]

The demo puts 40 proxies in the pool "demo-proxies" and forks 60 crawler processes. Each
crawler holds one proxy with a `ResourceThread` (renewed every ttl/3 in the background),
"fetches pages" through it for a few seconds, gives it back and queues again, so that
the 20 crawlers without a proxy get one in turn. Along the way a few crawlers are killed
with SIGKILL while they hold a proxy: nobody releases those proxies, the database lets
them go when their lease runs out, and a waiting crawler takes them.

A live table shows every proxy's holder, fencing token and seconds to expiry by the
database clock. At the end the demo checks from the crawlers' own reports that no proxy
was ever used by two holders at once (see `check_exclusivity`), prints a summary and
exits with 0 (OK) or 1 (FAILED).

How a use is reported, so that the check means something: before each step a crawler
reads its current lease and calls `lease.check()`; it times the step with
`time.monotonic()` (one clock for every process of the machine) and reports the window
[start, end] only if `lease.remaining() > 0` after the step, which proves the database
held the lease for it throughout the window (the engine's local deadline is never later
than the server's expiry, to within the server clock's resolution: 1 ms on SQLite).
That proof covers expiry only: an operator's `Pool.release()`, `quarantine()` or
`remove()` frees a row at once, and its holder only learns so at its next renewal (the
fencing token is what protects against that), so the demo does none of them while the
crawlers run; it frees leftovers of an earlier run before it starts them.

Crawlers report through a multiprocessing queue, never the database; the only writes are
the engine's own (acquire, renew, release).
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import os
import random
import shutil
import signal
import sys
import textwrap
import threading
import time
import traceback
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator

POOL = "demo-proxies"
CTX = multiprocessing.get_context("fork")
FORK_BLOCKED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

#: A crawl job keeps its proxy this long, then the crawler gives it back.
JOB_SECONDS = (2.0, 6.0)
#: One "page fetch" through the proxy.
STEP_SECONDS = (0.1, 0.3)
#: Pause between two jobs, so that crawlers already waiting get the freed proxies.
PAUSE_SECONDS = (0.5, 1.5)
#: Extra time a killed crawler's proxy may take to come back, beyond its ttl.
RECOVERY_SLACK = 0.5


# -- the exclusivity check (pure: no Django, no processes) -------------------------------


@dataclass(frozen=True)
class Use:
    """One step of a crawler's work through a proxy, held by it from `start` to `end`."""

    crawler: int
    pid: int
    proxy: str
    token: int
    start: float  # time.monotonic(): system-wide, so comparable between processes
    end: float


@dataclass
class Verdict:
    ok: bool
    problems: list[str]
    uses: int
    leases: int  # distinct (proxy, token) pairs
    proxies: int
    max_simultaneous: int  # most holders of one proxy at one instant


def check_exclusivity(uses: Iterable[Use], limit: int = 20) -> Verdict:
    """Check that no proxy was ever used by two holders at once, from reported uses.

    - every (proxy, token) pair was reported by one crawler process only;
    - the tokens of a proxy follow each other in time: all uses of a token end before
      the first use of the next higher token begins (so no two tokens overlap);
    - sweeping over every (proxy, token, crawler) span, at most one is active at once.
    """
    uses = list(uses)
    problems: list[str] = []
    spans: dict[tuple[str, int, int, int], list[float]] = {}
    for u in uses:
        if u.end < u.start:
            problems.append(
                f"{u.proxy} token {u.token}: crawler {u.crawler} reported a window that ends before it starts"
            )
        key = (u.proxy, u.token, u.crawler, u.pid)
        span = spans.setdefault(key, [u.start, u.end])
        span[0], span[1] = min(span[0], u.start), max(span[1], u.end)

    who: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    by_token: dict[tuple[str, int], list[float]] = {}
    for (proxy, token, crawler, pid), (start, end) in spans.items():
        who[(proxy, token)].append((crawler, pid))
        span = by_token.setdefault((proxy, token), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    for (proxy, token), holders in sorted(who.items()):
        if len(holders) > 1:
            names = ", ".join(f"crawler {c} (pid {p})" for c, p in sorted(holders))
            problems.append(f"{proxy} token {token} was used by {len(holders)} holders: {names}")

    per_proxy: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for (proxy, token), (start, end) in by_token.items():
        per_proxy[proxy].append((token, start, end))
    for proxy, tokens in sorted(per_proxy.items()):
        tokens.sort()
        for (t1, _, end1), (t2, start2, _) in zip(tokens, tokens[1:]):
            if start2 <= end1:
                problems.append(
                    f"{proxy}: token {t2} was in use {end1 - start2:.3f}s "
                    f"before token {t1} stopped being used"
                )

    most = 0
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for (proxy, _, _, _), (start, end) in spans.items():
        events[proxy] += [(start, 0), (end, 1)]  # a start sorts before an end at the same instant
    for evs in events.values():
        active = 0
        for _, kind in sorted(evs):
            active += 1 if kind == 0 else -1
            most = max(most, active)
    if most > 1:
        problems.append(f"max simultaneous holders of one proxy = {most}")
    if not uses:
        problems.append("no use was reported: nothing was checked")
    if len(problems) > limit:
        problems[limit:] = [f"... and {len(problems) - limit} more problems"]
    return Verdict(
        ok=not problems,
        problems=problems,
        uses=len(uses),
        leases=len(by_token),
        proxies=len(per_proxy),
        max_simultaneous=most,
    )


# -- options ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m project.demo",
        description="Crawler processes share a pool of proxies through django-leases; "
        "some are SIGKILLed and their proxies come back after the ttl.",
    )
    p.add_argument("--proxies", type=int, default=40, help="proxies in the pool (default 40)")
    p.add_argument("--crawlers", type=int, default=60, help="crawler processes (default 60)")
    p.add_argument(
        "--kills", type=int, default=5, help="crawlers to SIGKILL while they hold a proxy (default 5)"
    )
    p.add_argument("--seconds", type=float, default=30, help="how long the crawlers run (default 30)")
    p.add_argument("--ttl", type=float, default=3, help="lease ttl in seconds (default 3)")
    p.add_argument("--interval", type=float, default=None, help="renewal interval (default ttl/3)")
    p.add_argument("--pool", default=POOL, help=f"pool name (default {POOL})")
    p.add_argument(
        "--plain", action="store_true", help="status lines instead of the live table, even on a terminal"
    )
    opts = p.parse_args(argv)
    if opts.interval is None:
        opts.interval = opts.ttl / 3
    if opts.proxies < 1 or opts.proxies > 9999:
        p.error("--proxies must be between 1 and 9999")
    if opts.crawlers < 1:
        p.error("--crawlers must be at least 1")
    if not 0 <= opts.kills <= opts.crawlers:
        p.error("--kills must be between 0 and --crawlers")
    if opts.ttl <= 0 or not 0 < opts.interval < opts.ttl:
        p.error("--ttl must be > 0 and --interval between 0 and the ttl")
    if opts.seconds <= 0:
        p.error("--seconds must be > 0")
    if opts.kills and kill_window(opts)[1] < kill_window(opts)[0]:
        p.error(
            f"--seconds is too short for kills with ttl {opts.ttl:g}: "
            f"use at least {math.ceil(min_seconds(opts))}"
        )
    return opts


def kill_window(opts: argparse.Namespace) -> tuple[float, float]:
    """When kills may happen: after the crowd settled, early enough to see the recovery."""
    return max(0.2 * opts.seconds, min(opts.ttl, 2.0)), opts.seconds - opts.ttl - 2.0


def min_seconds(opts: argparse.Namespace) -> float:
    """The shortest --seconds for which `kill_window` is not empty."""
    return max((opts.ttl + 2.0) / 0.8, opts.ttl + 2.0 + min(opts.ttl, 2.0))


def proxy_names(count: int) -> list[tuple[str, dict]]:
    width = max(2, len(str(count)))
    return [
        (f"proxy-{i:0{width}d}", {"url": f"http://10.0.{(i - 1) // 254}.{(i - 1) % 254 + 1}:3128"})
        for i in range(1, count + 1)
    ]


# -- a crawler process ----------------------------------------------------------------------


def crawler_main(
    cid: int, opts: argparse.Namespace, out: Any, report_lock: Any, stop: Any, parent: int
) -> None:
    """Body of crawler process `cid`: jobs of a few seconds each, one proxy per job.

    Only this process's main thread writes to `out`, always under `report_lock`: the
    parent takes that lock before a SIGKILL, so a kill never lands in the middle of a
    write (which would corrupt the queue shared with every other crawler).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORK_BLOCKED)  # blocked by the parent around the fork
    from django.db import connections

    from leases import LeaseLost, ResourceThread

    class ProxyHolder(ResourceThread):
        pool = opts.pool
        wait_step = 1.0  # start() notices a stop request within about this long

        def is_valid(self) -> bool:
            return True  # a real crawler would check that the proxy answers

    pid = os.getpid()
    rng = random.Random(pid * 1_000_003 + time.time_ns())
    notes: deque[str] = deque()  # warnings from any thread, sent by the main thread

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage()[:300])

    engine_log = logging.getLogger("leases")
    engine_log.handlers = [Forward(logging.WARNING)]
    engine_log.propagate = False
    threading.excepthook = lambda a: notes.append(
        f"thread {a.thread.name} died: {a.exc_type.__name__}: {a.exc_value}"[:300]
    )

    def orphaned() -> bool:
        return os.getppid() != parent

    @contextmanager
    def reporting() -> Iterator[bool]:
        """Hold `report_lock`; yields False once the parent is gone (nobody reads any more)."""
        while not report_lock.acquire(timeout=0.5):
            if orphaned():  # it died holding our lock, in the middle of a kill
                yield False
                return
        try:
            yield not orphaned()
        finally:
            report_lock.release()

    def send(*msg: Any) -> None:
        with reporting() as ok:
            while ok and notes:
                out.put(("log", cid, pid, notes.popleft()))
            if ok:
                out.put(msg)

    quit = threading.Event()
    current: list[Any] = [None]
    current_lock = threading.Lock()

    def watch() -> None:
        """Stop when the parent says so or is gone; release the proxy on the way out."""
        while not stop.value and not orphaned() and not quit.wait(0.25):
            pass
        quit.set()
        with current_lock:
            thread = current[0]
        if thread is not None:
            thread.terminate()  # unblocks start() too, within wait_step
        connections.close_all()

    watcher = threading.Thread(target=watch, name="watch", daemon=True)
    watcher.start()
    try:
        while not quit.is_set():
            thread = ProxyHolder(
                ttl=opts.ttl, interval=opts.interval, holder=f"crawler-{cid}", name=f"crawler-{cid}"
            )
            with current_lock:
                if quit.is_set():
                    break
                current[0] = thread
            send("wait", cid, pid)
            thread.start()  # blocks until a proxy is held (or we are told to stop)
            connections.close_all()  # the heartbeat thread has its own connection
            job_end = time.monotonic() + rng.uniform(*JOB_SECONDS)
            seen = None
            while True:
                lease = thread.lease
                if lease is None:
                    break
                if lease is not seen:
                    if seen is not None:  # lost, and the thread took another in the background
                        send("lost", cid, pid, seen.name, seen.token)
                    send("lease", cid, pid, lease.name, lease.token, time.monotonic(), job_end)
                    seen = lease
                if quit.is_set() or time.monotonic() >= job_end:
                    break
                try:
                    lease.check()
                except LeaseLost:  # the thread is taking another in the background
                    time.sleep(0.05)
                    continue
                start = time.monotonic()
                time.sleep(rng.uniform(*STEP_SECONDS))  # fetch a page through lease.resource["url"]
                end = time.monotonic()
                if lease.remaining() > 0:  # still ours after `end`: the whole window was ours
                    send("use", cid, pid, lease.name, lease.token, start, end)
                else:
                    send("late", cid, pid, lease.name, lease.token)
            with reporting() as ok:  # not killed between giving the proxy back and saying so
                thread.terminate()
                if ok:
                    out.put(("release", cid, pid))
            connections.close_all()
            with current_lock:
                current[0] = None
            quit.wait(rng.uniform(*PAUSE_SECONDS))  # process the pages
        send("exit", cid, pid)
    except BaseException:
        send("error", cid, pid, traceback.format_exc()[-2500:])  # small: one atomic pipe write
        sys.exit(1)
    finally:
        quit.set()
        connections.close_all()


# -- the parent ------------------------------------------------------------------------------


def crawler_of(holder: str) -> int | None:
    """The crawler id in a holder string such as "crawler-17:3fa2b9c1"."""
    name = holder.split(":")[0]
    if name.startswith("crawler-") and name[8:].isdigit():
        return int(name[8:])
    return None


class Interrupted(Exception):
    pass


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


@dataclass
class Crawler:
    cid: int
    process: Any
    report_lock: Any
    state: str = "starting"  # waiting, running, idle, killed, exited, failed
    proxy: str | None = None
    token: int | None = None
    since: float = 0.0
    job_end: float = 0.0
    error: str | None = None


@dataclass
class Kill:
    crawler: int
    at: float  # seconds into the run
    at_db: datetime
    proxy: str | None = None
    token: int | None = None
    expires: datetime | None = None  # the dead lease's busy_before
    freed_after: float | None = None  # seconds from the kill until the database let it go
    taken_by: int | None = None
    taken_token: int | None = None
    taken_after: float | None = None
    early: bool = False  # taken before the dead lease ran out: must never happen

    def line(self) -> str:
        head = f"crawler {self.crawler} killed holding {self.proxy} (token {self.token})"
        if self.freed_after is None:
            return head + "; not free yet"
        text = f"{head}; {self.proxy} free again after {self.freed_after:.1f}s"
        if self.taken_token is None:
            return text + ", nobody took it yet"
        return text + f", now held by {self.taken_by_name()} (token {self.taken_token})"

    def taken_by_name(self) -> str:
        return f"crawler {self.taken_by}" if self.taken_by is not None else "another holder"

    def row(self) -> str:
        freed = "-" if self.freed_after is None else f"{self.freed_after:.1f}s"
        taken = "-" if self.taken_after is None else f"{self.taken_after:.1f}s"
        by = "-" if self.taken_token is None else f"{self.taken_by_name()} (#{self.taken_token})"
        crawler = f"crawler {self.crawler}"
        return f"{self.proxy:<10}#{self.token:<6}{crawler:<12}{self.at:9.1f}s{freed:>12}{taken:>10}   {by}"


GREEN, RED, DIM, RESET = "\x1b[32m", "\x1b[31m", "\x1b[2m", "\x1b[0m"
CELL = 39  # one proxy in the table (37 characters) and the gap after it


class Demo:
    def __init__(self, opts: argparse.Namespace) -> None:
        from django.db import connection

        from leases import Pool

        self.opts = opts
        self.pool = Pool(opts.pool)
        self.tty = sys.stdout.isatty() and not opts.plain and os.environ.get("TERM") != "dumb"
        self.rng = random.Random()
        s = connection.settings_dict
        self.where = f"{connection.vendor} {s['NAME']}" + (
            f" on {s['HOST'] or 'localhost'}" if connection.vendor == "mysql" else ""
        )
        self.crawlers: dict[int, Crawler] = {}
        self.inbox: deque = deque()
        self.uses: list[Use] = []
        self.granted: dict[tuple[str, int], int] = {}
        self.late = self.lost = 0
        self.kills: list[Kill] = []
        self.events: list[str] = []
        self.start = time.monotonic()
        self.rows: list = []
        self.now_db: datetime | None = None
        self.tokens_at_start = 0
        # A flag, not a multiprocessing Event: an Event's condition counts its sleepers, and a
        # crawler SIGKILLed while waiting on it would make every later set() hang forever.
        self.stop = CTX.RawValue("b", 0)
        self.queue = CTX.SimpleQueue()
        self._reading = threading.Event()
        self.reader: threading.Thread | None = None

    # -- set-up ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Create the pool (idempotent) and free what an earlier run left, via the engine."""
        from leases.models import Resource
        from leases.pool import db_now

        wanted = proxy_names(self.opts.proxies)
        names = {n for n, _ in wanted}
        before = set(self.pool.resources().values_list("name", flat=True))
        self.pool.add_many(wanted)
        removed = [n for n in before - names if self.pool.remove(n)]
        now = db_now()
        reset = 0
        for row in self.pool.resources():
            state = row.state_at(now)
            if state == Resource.QUARANTINED:
                reset += self.pool.unquarantine(row.name)
            elif state == Resource.HELD:
                reset += self.pool.release(row.name)
        self.tokens_at_start = sum(self.pool.resources().values_list("token", flat=True))
        extra = f", {len(removed)} removed" if removed else ""
        print(
            f"pool {self.opts.pool!r} on {self.where}: {len(names)} proxies "
            f"({len(names - before)} new{extra}; "
            f"{reset} left held or quarantined by an earlier run freed via the engine)"
        )

    # -- processes ------------------------------------------------------------------------

    def spawn(self) -> None:
        from django.db import connections

        connections.close_all()  # never share a database connection with a child
        for cid in range(1, self.opts.crawlers + 1):
            lock = CTX.Lock()
            proc = CTX.Process(
                target=crawler_main,
                args=(cid, self.opts, self.queue, lock, self.stop, os.getpid()),
                name=f"crawler-{cid}",
                daemon=True,
            )
            # A Ctrl-C during the fork reaches us once the child is on the books (so the
            # clean-up stops it), and never reaches a child before it ignores Ctrl-C.
            signal.pthread_sigmask(signal.SIG_BLOCK, FORK_BLOCKED)
            try:
                proc.start()
                self.crawlers[cid] = Crawler(cid, proc, lock)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORK_BLOCKED)
        self.reader = threading.Thread(target=self._read, name="reader", daemon=True)
        self._reading.set()
        self.reader.start()

    def _read(self) -> None:
        # Drain the pipe continuously: a full pipe would block writers inside their lock.
        while self._reading.is_set():
            if self.queue.empty():
                time.sleep(0.02)
            else:
                self.inbox.append(self.queue.get())

    def shutdown(self) -> None:
        """Stop every crawler: politely (they release their proxies), then by force."""
        self.stop.value = 1
        deadline = time.monotonic() + 10
        for c in self.crawlers.values():
            c.process.join(max(0.1, deadline - time.monotonic()))
        for c in self.crawlers.values():
            if c.process.is_alive():
                c.process.kill()
                c.error = c.error or "did not stop within 10s and was killed"
        for c in self.crawlers.values():
            c.process.join(5)
        self._reading.clear()
        if self.reader is not None:
            self.reader.join(5)
        while not self.queue.empty():
            self.inbox.append(self.queue.get())
        self.handle_inbox()

    # -- what the crawlers report ------------------------------------------------------------

    def handle_inbox(self) -> None:
        while self.inbox:
            self.handle(self.inbox.popleft())

    def handle(self, msg: tuple) -> None:
        kind, cid, pid, *rest = msg
        c = self.crawlers[cid]
        alive = c.state != "killed"
        if kind == "use":
            self.uses.append(Use(cid, pid, *rest))
        elif kind == "lease":
            proxy, token, since, job_end = rest
            self.granted.setdefault((proxy, token), cid)
            if alive:
                c.state, c.proxy, c.token, c.since, c.job_end = "running", proxy, token, since, job_end
        elif kind == "late":
            self.late += 1
        elif kind == "lost":
            self.lost += 1
            if alive:
                c.state = "waiting"
        elif kind == "wait" and alive:
            c.state = "waiting"
        elif kind == "release" and alive:
            c.state, c.proxy, c.token = "idle", None, None
        elif kind == "exit" and alive:
            c.state = "exited"
        elif kind == "log":
            self.event(f"crawler {cid}: {rest[0]}")
        elif kind == "error":
            c.error = rest[0]
            c.state = "failed"
            self.event(f"crawler {cid} failed: {rest[0].strip().splitlines()[-1]}")

    def event(self, text: str) -> None:
        line = f"{time.monotonic() - self.start:6.1f}s  {text}"
        self.events.append(line)
        if not self.tty:
            print(line, flush=True)

    # -- kills and recoveries ------------------------------------------------------------------

    def kill_one(self) -> bool:
        """SIGKILL a crawler in the middle of a job; note what the database says it held."""
        from leases.models import Resource
        from leases.pool import db_now

        self.handle_inbox()
        now = time.monotonic()
        candidates = [
            c
            for c in self.crawlers.values()
            if c.state == "running"
            and c.process.is_alive()
            and now - c.since >= min(self.opts.interval, 1.0)
            and c.job_end - now > 1.0
        ]
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        if not victim.report_lock.acquire(timeout=1.0):
            return False
        try:
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.join(5)
        finally:
            victim.report_lock.release()
        at_db = db_now()
        kill = Kill(victim.cid, time.monotonic() - self.start, at_db)
        victim.state = "killed"
        prefix = f"crawler-{victim.cid}:"
        held = [
            r
            for r in self.pool.resources().filter(holder__startswith=prefix)
            if r.state_at(at_db) == Resource.HELD
        ]
        if held:
            row = held[0]
            kill.proxy, kill.token, kill.expires = row.name, row.token, row.busy_before
            left = (row.busy_before - at_db).total_seconds()
            self.event(
                f"crawler {victim.cid} SIGKILLed holding {row.name} (token {row.token}); "
                f"nobody will release it, the lease runs out in {left:.1f}s"
            )
        else:
            self.event(f"crawler {victim.cid} SIGKILLed; the database shows it held no proxy")
        self.kills.append(kill)
        return True

    def track_recoveries(self) -> None:
        from leases.models import Resource

        rows = {r.name: r for r in self.rows}
        for k in self.kills:
            if k.proxy is None or k.taken_token is not None or k.proxy not in rows:
                continue
            row = rows[k.proxy]
            if row.token == k.token:
                if row.busy_before > k.expires:  # a renewal was in flight when it died
                    k.expires = row.busy_before
                if row.state_at(self.now_db) != Resource.HELD and k.freed_after is None:
                    k.freed_after = (k.expires - k.at_db).total_seconds()
                continue
            # The token moved on: the engine granted the proxy again.
            k.freed_after = (k.expires - k.at_db).total_seconds()
            k.taken_token = k.token + 1
            k.taken_by = self.granted.get((k.proxy, k.taken_token))
            if row.token == k.taken_token and row.acquired_at is not None:
                k.taken_after = (row.acquired_at - k.at_db).total_seconds()
                k.early = row.acquired_at < k.expires
                if k.taken_by is None:
                    k.taken_by = crawler_of(row.holder)
            else:  # granted more than once since the last look: an upper bound
                k.taken_after = (self.now_db - k.at_db).total_seconds()
            self.event(k.line())

    # -- display --------------------------------------------------------------------------------

    def poll(self) -> None:
        from leases.pool import db_now

        self.now_db = db_now()
        self.rows = list(self.pool.resources())

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        proxies = {"held": 0, "free": 0, "quarantined": 0}
        for r in self.rows:
            proxies[r.state_at(self.now_db)] += 1
        crawlers = {"running": 0, "waiting": 0, "idle": 0, "killed": 0}
        for c in self.crawlers.values():
            key = {"starting": "waiting", "exited": "idle", "failed": "idle"}.get(c.state, c.state)
            crawlers[key] += 1
        return proxies, crawlers

    def status(self) -> str:
        p, c = self.counts()
        return (
            f"proxies {p['held']} held, {p['free']} free, {p['quarantined']} quarantined | "
            f"crawlers {c['running']} running, {c['waiting']} waiting, {c['idle']} between jobs, "
            f"{c['killed']} killed | {len(self.granted)} leases granted, {len(self.uses)} uses"
        )

    def cell(self, row: Any) -> tuple[str, str]:
        """One proxy: (plain text, colour)."""
        from leases.models import Resource

        state = row.state_at(self.now_db)
        if state == Resource.FREE:
            return f"{row.name:<10}{'free':<13}#{row.token:<5}{'':>8}", GREEN
        if state == Resource.QUARANTINED:
            return f"{row.name:<10}{'quarantined':<13}#{row.token:<5}{'':>8}", DIM
        who, colour = row.holder.split(":")[0][:12], ""
        cid = crawler_of(row.holder)
        if cid in self.crawlers and self.crawlers[cid].state == "killed":
            who, colour = f"killed-{cid}", RED
        left = (row.busy_before - self.now_db).total_seconds()
        return f"{row.name:<10}{who:<13}#{row.token:<5}{left:7.1f}s", colour

    def frame(self) -> str:
        """One screen: 3 header lines, the table, then the legend and events if room is left."""
        width, height = shutil.get_terminal_size((100, 40))
        p, c = self.counts()
        elapsed = time.monotonic() - self.start
        clock = f"{self.now_db:%H:%M:%S.%f}"[:-3]
        head = [
            f"django-leases demo {elapsed:5.1f}s of {self.opts.seconds:g}s   database clock {clock} UTC   "
            f"ttl {self.opts.ttl:g}s, renewal every {self.opts.interval:.2g}s   {self.where}",
            f"proxies   {p['held']:3} held  {p['free']:3} free  {p['quarantined']:3} quarantined      "
            f"{len(self.granted)} leases granted, {len(self.uses)} uses",
            f"crawlers  {c['running']:3} running  {c['waiting']:3} waiting  {c['idle']:3} between jobs  "
            f"{c['killed']:3} killed",
        ]
        n = len(self.rows)
        most = max(1, (width + 2) // CELL)
        ncols = most
        for cols in range(1, most + 1):  # fewest columns that leave room for the legend and events
            if len(head) + 1 + math.ceil(n / cols) + 5 <= height:
                ncols = cols
                break
        nrows = math.ceil(n / ncols) if n else 0
        room = height - len(head) - 1
        shown = nrows if nrows <= room else max(0, room - 1)
        table = [
            "  ".join([f"{'proxy':<10}{'holder':<13}{'token':<6}{'expires':>8}"] * min(ncols, max(n, 1)))
        ]
        for i in range(shown):
            parts = []
            for j in range(ncols):
                k = j * nrows + i
                if k < n:
                    text, colour = self.cell(self.rows[k])
                    parts.append(f"{colour}{text}{RESET}" if colour else text)
            table.append("  ".join(parts))
        if shown < nrows:
            table.append(f"... {n - shown * ncols} more proxies: enlarge the terminal")
        lines = [h[:width] for h in head]
        spare = height - len(lines) - len(table)
        if spare >= 1:
            lines.append("")
            spare -= 1
        lines += table
        if spare >= 2:
            legend = "killed-N: held by a SIGKILLed crawler; nobody renews it, the database frees it at 0.0s"
            lines += ["", legend[:width]]
            spare -= 2
        if spare > 0:
            wrapped = [
                w for e in self.events[-spare:] for w in textwrap.wrap(e, width, subsequent_indent=" " * 9)
            ]
            lines += wrapped[-spare:]
        return "\x1b[H" + "\n".join(line + "\x1b[K" for line in lines) + "\x1b[J"

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> int:
        opts = self.opts
        self.setup()
        first, last = kill_window(opts)
        kill_at = [first + (last - first) * (i + 0.5) / opts.kills for i in range(opts.kills)]
        interrupted = None
        old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        if self.tty:
            sys.stdout.write("\x1b[2J\x1b[?25l")
        try:
            print(f"starting {opts.crawlers} crawler processes for {opts.seconds:g}s ...", flush=True)
            self.start = time.monotonic()
            self.spawn()
            next_poll = next_status = 0.0
            while True:
                elapsed = time.monotonic() - self.start
                if elapsed >= opts.seconds:
                    break
                self.handle_inbox()
                if kill_at and elapsed >= kill_at[0]:
                    if self.kill_one() or elapsed > last + 1.0:
                        kill_at.pop(0)
                if elapsed >= next_poll:
                    self.poll()
                    self.track_recoveries()
                    next_poll = elapsed + 0.5
                    if self.tty:
                        sys.stdout.write(self.frame())
                        sys.stdout.flush()
                    elif elapsed >= next_status:
                        print(f"{elapsed:6.1f}s  {self.status()}", flush=True)
                        next_status = elapsed + 3.0
                time.sleep(0.1)
        except (KeyboardInterrupt, Interrupted) as exc:
            interrupted = exc
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
            try:
                self.shutdown()
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
                if self.tty:
                    sys.stdout.write("\x1b[?25h")
                    sys.stdout.flush()
        elapsed = time.monotonic() - self.start
        self.poll()
        self.track_recoveries()
        if self.tty:
            sys.stdout.write("\n")  # the last live frame stays on the screen
        ok = self.summary(elapsed, interrupted)
        if interrupted is not None:
            return 130
        return 0 if ok else 1

    def summary(self, elapsed: float, interrupted: Any) -> bool:
        opts = self.opts
        verdict = check_exclusivity(self.uses)
        failures = list(verdict.problems)
        holding = [k for k in self.kills if k.proxy is not None]
        recovered = [k for k in holding if k.freed_after is not None]
        for k in holding:
            if k.freed_after is None:
                failures.append(f"{k.proxy} of killed crawler {k.crawler} never came back")
            elif k.freed_after > opts.ttl + RECOVERY_SLACK:
                failures.append(f"{k.proxy} came back {k.freed_after:.1f}s after the kill, more than the ttl")
            if k.early:
                failures.append(f"{k.proxy} was granted again before the killed crawler's lease ran out")
        if interrupted is None and len(holding) < opts.kills:
            failures.append(f"only {len(holding)} of {opts.kills} kills hit a crawler holding a proxy")
        for c in self.crawlers.values():
            if c.error:
                failures.append(f"crawler {c.cid}: {c.error.strip().splitlines()[-1]}")
            elif c.state != "killed" and c.process.exitcode not in (0, None):
                failures.append(f"crawler {c.cid} exited with code {c.process.exitcode}")
        p, _ = self.counts()
        tokens = sum(r.token for r in self.rows) - self.tokens_at_start

        def say(label: str, text: str) -> None:
            print(f"  {label:<16}{text}")

        print()
        print("summary")
        say(
            "run",
            f"{elapsed:.1f}s, {opts.proxies} proxies, {opts.crawlers} crawlers, ttl {opts.ttl:g}s, "
            f"renewal every {opts.interval:.2g}s, {self.where}",
        )
        say(
            "acquisitions",
            f"{len(self.granted)} reported by crawlers, fencing tokens grew by {tokens}; "
            f"{self.lost} lost to late renewals",
        )
        say(
            "uses",
            f"{verdict.uses} confirmed steps; {self.late} not counted "
            "(lease gone by the step's end, mostly at shutdown)",
        )
        say("kills", f"{len(self.kills)} crawler(s) SIGKILLed, {len(holding)} of them holding a proxy")
        say(
            "recovered", f"{len(recovered)}/{len(holding)} proxies of killed crawlers came back after the ttl"
        )
        if holding:
            print(
                f"    {'proxy':<10}{'token':<7}{'crawler':<12}"
                f"{'killed at':>10}{'free again':>12}{'retaken':>10}   by"
            )
        for k in holding:
            print(f"    {k.row()}")
        say(
            "exclusivity",
            f"{'OK' if verdict.ok else 'FAILED'}: {verdict.uses} uses of {verdict.leases} "
            f"(proxy, token) leases on {verdict.proxies} proxies",
        )
        say(
            "",
            "each lease used by one crawler, tokens in time order, "
            f"max simultaneous holders per proxy = {verdict.max_simultaneous}",
        )
        say("after shutdown", f"{p['free']} free, {p['held']} held, {p['quarantined']} quarantined")
        if interrupted is not None:  # only the exclusivity check is complete
            for problem in verdict.problems:
                say("problem", problem)
            why = str(interrupted) or "Ctrl-C"
            print(f"verdict: interrupted ({why}) after {elapsed:.1f}s; every crawler stopped")
            return False
        for problem in failures:
            say("problem", problem)
        ok = not failures
        print(f"verdict: {'OK' if ok else 'FAILED'}", flush=True)
        return ok


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.db import connection

    if "leases_resource" not in connection.introspection.table_names():
        print("the leases table is missing: run `python manage.py migrate` first", file=sys.stderr)
        return 2
    return Demo(opts).run()


if __name__ == "__main__":
    sys.exit(main())
