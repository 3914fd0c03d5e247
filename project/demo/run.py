"""The parent's run: set up the pool, fork the crawlers, kill a few, watch, stop, report."""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

from . import display
from .crawler import CTX, FORK_BLOCKED, Crawler, crawler_main
from .kills import Kill, kill_times, kill_window
from .scoreboard import Scoreboard


class Interrupted(Exception):
    """SIGTERM or SIGHUP: stop the crawlers and report, as after Ctrl-C."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def proxy_names(count: int) -> list[tuple[str, dict]]:
    """The pool's proxies: names that sort in order, and made-up addresses."""
    width = max(2, len(str(count)))
    return [
        (f"proxy-{i:0{width}d}", {"url": f"http://10.0.{(i - 1) // 254}.{(i - 1) % 254 + 1}:3128"})
        for i in range(1, count + 1)
    ]


class Demo:
    """The parent: it owns the crawler processes, reads their messages and does the kills."""

    def __init__(self, opts: argparse.Namespace) -> None:
        from django.db import connection

        from leases import Pool

        self.opts = opts
        self.pool = Pool(opts.pool)
        tty = sys.stdout.isatty() and not opts.plain and os.environ.get("TERM") != "dumb"
        s = connection.settings_dict
        where = f"{connection.vendor} {s['NAME']}" + (
            f" on {s['HOST'] or 'localhost'}" if connection.vendor == "mysql" else ""
        )
        self.board = Scoreboard(opts, where, tty)
        self.rng = random.Random()
        self.inbox: deque = deque()
        # A flag, not a multiprocessing Event: an Event's condition counts its sleepers, and a
        # crawler SIGKILLed while waiting on it would make every later set() hang forever.
        self.stop = CTX.RawValue("b", 0)
        self.queue = CTX.SimpleQueue()
        self._reading = threading.Event()
        self.reader: threading.Thread | None = None

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        """The whole demo; returns the exit code: 0 OK, 1 FAILED, 130 interrupted."""
        opts, board = self.opts, self.board
        self.setup()
        interrupted = None
        old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        if board.tty:
            sys.stdout.write("\x1b[2J\x1b[?25l")  # clear the screen, hide the cursor
        try:
            print(f"starting {opts.crawlers} crawler processes for {opts.seconds:g}s ...", flush=True)
            board.start = time.monotonic()
            self.spawn()
            self.supervise()
        except (KeyboardInterrupt, Interrupted) as exc:
            interrupted = exc
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the clean-up
            try:
                self.shutdown()
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
                if board.tty:
                    sys.stdout.write("\x1b[?25h")  # show the cursor again
                    sys.stdout.flush()
        elapsed = time.monotonic() - board.start
        self.poll()
        board.track_recoveries()
        if board.tty:
            sys.stdout.write("\n")  # the last live frame stays on the screen
        ok = display.summary(board, elapsed, interrupted)
        if interrupted is not None:
            return 130
        return 0 if ok else 1

    # -- set-up ------------------------------------------------------------------------------

    def setup(self) -> None:
        """Create the pool (idempotent) and free what an earlier run left, via the engine."""
        from leases.clock import db_now
        from leases.models import Resource

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
        self.board.tokens_at_start = sum(self.pool.resources().values_list("token", flat=True))
        extra = f", {len(removed)} removed" if removed else ""
        print(
            f"pool {self.opts.pool!r} on {self.board.where}: {len(names)} proxies "
            f"({len(names - before)} new{extra}; "
            f"{reset} left held or quarantined by an earlier run freed via the engine)"
        )

    # -- processes ---------------------------------------------------------------------------

    def spawn(self) -> None:
        """Fork the crawlers, then read their messages in the background."""
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
                self.board.crawlers[cid] = Crawler(cid, proc, lock)
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

    def handle_inbox(self) -> None:
        """Hand the messages read so far to the scoreboard."""
        while self.inbox:
            self.board.handle(self.inbox.popleft())

    def supervise(self) -> None:
        """Until --seconds are up: take the messages in, kill on time, redraw every 0.5s."""
        opts, board = self.opts, self.board
        kill_at = kill_times(opts)
        last = kill_window(opts)[1]
        next_poll = next_status = 0.0
        while True:
            elapsed = time.monotonic() - board.start
            if elapsed >= opts.seconds:
                break
            self.handle_inbox()
            if kill_at and elapsed >= kill_at[0]:
                if self.kill_one() or elapsed > last + 1.0:  # killed, or too late to find a victim
                    kill_at.pop(0)
            if elapsed >= next_poll:
                self.poll()
                board.track_recoveries()
                next_poll = elapsed + 0.5
                if board.tty:
                    sys.stdout.write(display.frame(board))
                    sys.stdout.flush()
                elif elapsed >= next_status:
                    print(f"{elapsed:6.1f}s  {display.status(board)}", flush=True)
                    next_status = elapsed + 3.0
            time.sleep(0.1)

    def poll(self) -> None:
        """Read the pool's rows and the database clock, for the table and the recoveries."""
        from leases.clock import db_now

        self.board.now_db = db_now()
        self.board.rows = list(self.pool.resources())

    # -- kills -------------------------------------------------------------------------------

    def kill_one(self) -> bool:
        """SIGKILL a crawler in the middle of a job; note what the database says it held."""
        from leases.clock import db_now
        from leases.models import Resource

        self.handle_inbox()
        victim = self._victim()
        if victim is None or not victim.sigkill():
            return False
        at_db = db_now()
        kill = Kill(victim.cid, time.monotonic() - self.board.start, at_db)
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
            self.board.event(
                f"crawler {victim.cid} SIGKILLed holding {row.name} (token {row.token}); "
                f"nobody will release it, the lease runs out in {left:.1f}s"
            )
        else:
            self.board.event(f"crawler {victim.cid} SIGKILLed; the database shows it held no proxy")
        self.board.kills.append(kill)
        return True

    def _victim(self) -> Crawler | None:
        """A running crawler, at random, that has held its proxy a while and keeps it 1s more."""
        now = time.monotonic()
        candidates = [
            c
            for c in self.board.crawlers.values()
            if c.state == "running"
            and c.process.is_alive()
            and now - c.since >= min(self.opts.interval, 1.0)
            and c.job_end - now > 1.0
        ]
        return self.rng.choice(candidates) if candidates else None

    # -- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every crawler: politely (they release their proxies), then by force."""
        crawlers = self.board.crawlers.values()
        self.stop.value = 1
        deadline = time.monotonic() + 10
        for c in crawlers:
            c.process.join(max(0.1, deadline - time.monotonic()))
        for c in crawlers:
            if c.process.is_alive():
                c.process.kill()
                c.error = c.error or "did not stop within 10s and was killed"
        for c in crawlers:
            c.process.join(5)
        self._reading.clear()
        if self.reader is not None:
            self.reader.join(5)
        while not self.queue.empty():
            self.inbox.append(self.queue.get())
        self.handle_inbox()
