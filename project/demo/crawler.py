"""A crawler process: what runs in the forked child, and the parent's record of it.

A crawler holds one proxy per job with a `ResourceThread` (renewed every ttl/3 in the
background), "fetches pages" through it, gives it back and queues again. It reports
through a multiprocessing queue, never the database: the only writes are the engine's
own (acquire, renew, release).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

CTX = multiprocessing.get_context("fork")
FORK_BLOCKED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

#: A crawl job keeps its proxy this long, then the crawler gives it back.
JOB_SECONDS = (2.0, 6.0)
#: One "page fetch" through the proxy.
STEP_SECONDS = (0.1, 0.3)
#: Pause between two jobs, so that crawlers already waiting get the freed proxies.
PAUSE_SECONDS = (0.5, 1.5)


# -- the child ----------------------------------------------------------------------------------


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
    report = Reporter(cid, out, report_lock, parent)
    forward_warnings(report.notes)
    Jobs(cid, opts, report, stop).run()


class Jobs:
    """A crawler's work, job after job, until the parent says stop or is gone.

    The main thread runs the jobs and is the only one to report; a watcher thread
    notices the stop and ends the current job's lease.
    """

    def __init__(self, cid: int, opts: argparse.Namespace, report: Reporter, stop: Any) -> None:
        self.cid = cid
        self.opts = opts
        self.report = report
        self.stop = stop
        self.holder_class = proxy_holder(opts.pool)
        self.rng = random.Random(report.pid * 1_000_003 + time.time_ns())
        self.quit = threading.Event()
        self.current: Any = None  # the job's ProxyHolder, for the watcher to terminate
        self.current_lock = threading.Lock()

    def run(self) -> None:
        """Job after job until told to stop; then say how it ended: exit, or error."""
        watcher = threading.Thread(target=self.watch, name="watch", daemon=True)
        watcher.start()
        try:
            while not self.quit.is_set():
                if not self.job():
                    break
            self.report.send("exit")
        except BaseException:
            self.report.send("error", traceback.format_exc()[-2500:])  # small: one atomic pipe write
            sys.exit(1)
        finally:
            self.quit.set()
            close_connections()

    def watch(self) -> None:
        """Stop when the parent says so or is gone; release the proxy on the way out."""
        while not self.stop.value and not self.report.orphaned() and not self.quit.wait(0.25):
            pass
        self.quit.set()
        with self.current_lock:
            thread = self.current
        if thread is not None:
            thread.terminate()  # unblocks start() too, within wait_step
        close_connections()

    def job(self) -> bool:
        """Wait for a proxy, crawl through it, give it back; False if told to stop first."""
        thread = self.holder_class(
            ttl=self.opts.ttl,
            interval=self.opts.interval,
            holder=f"crawler-{self.cid}",
            name=f"crawler-{self.cid}",
        )
        with self.current_lock:
            if self.quit.is_set():
                return False
            self.current = thread
        self.report.send("wait")
        thread.start()  # blocks until a proxy is held (or we are told to stop)
        close_connections()  # the heartbeat thread has its own connection
        self.crawl(thread, time.monotonic() + self.rng.uniform(*JOB_SECONDS))
        with self.report.locked() as ok:  # not killed between giving the proxy back and saying so
            thread.terminate()
            if ok:
                self.report.put("release")
        close_connections()
        with self.current_lock:
            self.current = None
        self.quit.wait(self.rng.uniform(*PAUSE_SECONDS))  # process the pages
        return True

    def crawl(self, thread: Any, job_end: float) -> None:
        """Step through the proxy until `job_end`, reporting each lease the thread holds."""
        from leases import LeaseLost

        seen = None
        while True:
            lease = thread.lease
            if lease is None:
                break
            if lease is not seen:
                if seen is not None:  # lost, and the thread took another in the background
                    self.report.send("lost", seen.name, seen.token)
                self.report.send("lease", lease.name, lease.token, time.monotonic(), job_end)
                seen = lease
            if self.quit.is_set() or time.monotonic() >= job_end:
                break
            try:
                lease.check()
            except LeaseLost:  # the thread is taking another in the background
                time.sleep(0.05)
                continue
            self.step(lease)

    def step(self, lease: Any) -> None:
        """One page fetch, reported as a use only if the lease covered all of it (see `proof`)."""
        start = time.monotonic()
        time.sleep(self.rng.uniform(*STEP_SECONDS))  # fetch a page through lease.resource["url"]
        end = time.monotonic()
        if lease.remaining() > 0:  # still ours after `end`: the whole window was ours
            self.report.send("use", lease.name, lease.token, start, end)
        else:
            self.report.send("late", lease.name, lease.token)


class Reporter:
    """A crawler's messages to the parent: (kind, crawler id, pid, ...) on the shared queue."""

    def __init__(self, cid: int, out: Any, report_lock: Any, parent: int) -> None:
        self.cid = cid
        self.pid = os.getpid()
        self.out = out
        self.report_lock = report_lock
        self.parent = parent
        self.notes: deque[str] = deque()  # warnings from any thread, sent by the main thread

    def orphaned(self) -> bool:
        """The parent is gone: this process was handed to another."""
        return os.getppid() != self.parent

    @contextmanager
    def locked(self) -> Iterator[bool]:
        """Hold `report_lock`; yields False once the parent is gone (nobody reads any more)."""
        while not self.report_lock.acquire(timeout=0.5):
            if self.orphaned():  # it died holding our lock, in the middle of a kill
                yield False
                return
        try:
            yield not self.orphaned()
        finally:
            self.report_lock.release()

    def put(self, kind: str, *rest: Any) -> None:
        """Write one message; only inside `locked()`."""
        self.out.put((kind, self.cid, self.pid, *rest))

    def send(self, kind: str, *rest: Any) -> None:
        """Write the warnings noted so far, then this message."""
        with self.locked() as ok:
            while ok and self.notes:
                self.put("log", self.notes.popleft())
            if ok:
                self.put(kind, *rest)


def forward_warnings(notes: deque[str]) -> None:
    """Note the engine's warnings and any thread's death, for the parent to show."""

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage()[:300])

    engine_log = logging.getLogger("leases")
    engine_log.handlers = [Forward(logging.WARNING)]
    engine_log.propagate = False
    threading.excepthook = lambda a: notes.append(
        f"thread {a.thread.name} died: {a.exc_type.__name__}: {a.exc_value}"[:300]
    )


def proxy_holder(pool_name: str) -> type:
    """The `ResourceThread` a crawler holds its proxy with (Django is set up by now)."""
    from leases import ResourceThread

    class ProxyHolder(ResourceThread):
        pool = pool_name
        wait_step = 1.0  # start() notices a stop request within about this long

        def is_valid(self) -> bool:
            return True  # a real crawler would check that the proxy answers

    return ProxyHolder


def close_connections() -> None:
    """Close this thread's database connections; each thread and process opens its own."""
    from django.db import connections

    connections.close_all()


# -- the parent's side ------------------------------------------------------------------------


@dataclass
class Crawler:
    """The parent's record of crawler process `cid`, as its reports left it."""

    cid: int
    process: Any
    report_lock: Any
    state: str = "starting"  # waiting, running, idle, killed, exited, failed
    proxy: str | None = None
    token: int | None = None
    since: float = 0.0
    job_end: float = 0.0
    error: str | None = None

    def sigkill(self) -> bool:
        """SIGKILL the process between two of its reports; False if it held its lock over 1s."""
        if not self.report_lock.acquire(timeout=1.0):
            return False
        try:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join(5)
        finally:
            self.report_lock.release()
        return True


def crawler_of(holder: str) -> int | None:
    """The crawler id in a holder string such as "crawler-17:3fa2b9c1"."""
    name = holder.split(":")[0]
    if name.startswith("crawler-") and name[8:].isdigit():
        return int(name[8:])
    return None
