"""ResourceThread: hold one resource for the life of a worker, heartbeating in the background."""
from __future__ import annotations

import logging
import math
import threading
import time

from django.db import Error, connections

from . import db
from .exceptions import NoResourceAvailable, UnknownPool, UnknownResource
from .lease import Lease, keep_alive, release_within
from .pool import Pool

log = logging.getLogger("leases")


class ResourceThread(threading.Thread):
    """Base class of a worker's hold on one resource of `pool`.

    Subclass it, set `pool`, `ttl` and `interval` (default ttl/3), and override
    `is_valid()`. `start()` blocks until a valid resource is held (logging while the
    pool is exhausted or the database unreachable), then the thread renews the lease
    every `interval`; when the lease is lost it acquires again, for as long as it takes.
    The current lease is `self.lease`: read it each time you use the resource, it
    changes after a loss or `fix()`.

    Between a loss and the next acquisition `self.lease` stays the lost lease, so code
    that reads it keeps working and learns the truth from it: `check()` raises LeaseLost
    and `remaining()` is 0. It is None only before the first acquisition.

    A process that dies stops heartbeating, and its resource frees itself after `ttl`.
    """

    pool: str = ""
    ttl: float = 60
    interval: float | None = None
    #: How long a resource that fails `is_valid()` stays out of service.
    quarantine_for: float = 86400
    #: How often a waiting worker (exhausted pool, database down) says so in the log.
    wait_step: float = 5
    #: How soon a waiting start() notices terminate() while the database answers.
    _poll = 1.0
    holder: str | None = None

    def __init__(
        self,
        pool: str | None = None,
        ttl: float | None = None,
        interval: float | None = None,
        holder: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._pool = Pool(pool or self.pool)
        self.ttl = ttl if ttl is not None else self.ttl
        self.interval = interval if interval is not None else (self.interval or self.ttl / 3)
        self.holder = holder if holder is not None else self.holder
        self.lease: Lease | None = None
        self._stopping = threading.Event()
        self._swap = threading.Lock()  # one thread at a time replaces self.lease
        # Held while a new lease is published and while terminate() stops: a lease
        # acquired as terminate() comes is released by exactly one of the two.
        self._publish = threading.Lock()

    def is_valid(self) -> bool:
        """Whether `self.lease`'s resource works (a proxy answers, an account logs in).

        An exception raised here counts as False, and becomes the quarantine reason: a
        check that cannot run cannot vouch for the resource.
        """
        return True

    def start(self) -> None:
        """Acquire a valid resource, blocking through an exhausted pool and database
        outages, then start heartbeating.

        What waiting cannot cure is raised here: UnknownPool, or a database error that
        is not an outage (a missing table, bad credentials). If terminate() is called
        meanwhile, it returns without starting the thread.
        """
        with self._swap:
            self._acquire(background=False)
        if self.lease is not None and not self._stopping.is_set():
            super().start()

    def _invalid(self) -> str | None:
        """None if `self.lease`'s resource is valid, else why not."""
        try:
            if self.is_valid():
                return None
            return f"{type(self).__name__}.is_valid() returned False"
        except Exception as exc:  # the user's check failing must not end the thread
            log.warning("%s: is_valid() raised on %s: %s", self.name, self.lease, db.one_line(exc))
            return f"{type(self).__name__}.is_valid() raised {type(exc).__name__}: {exc}"

    def _acquire(self, background: bool, lost: Lease | None = None) -> None:
        """Put a valid lease in self.lease, trying until one is held or terminate() is called.

        An exhausted pool and database outages are waited out (with backoff), saying so
        in the log at most every `wait_step` seconds; invalid resources are quarantined.
        In the background nothing ends the search but terminate(): an emptied pool or a
        database error that is no outage is logged and tried again, since a dead thread
        would leave the worker without a resource for good. `lost` is the lease this one
        replaces, for the log line that says when a resource is held again.
        """
        started = time.monotonic()
        said = -math.inf
        failures = 0
        troubled = False

        def due() -> bool:
            nonlocal said
            if time.monotonic() - said < self.wait_step:
                return False
            said = time.monotonic()
            return True

        while not self._stopping.is_set():
            try:
                wait = min(self._poll, self.wait_step)
                lease = self._pool.acquire(ttl=self.ttl, wait=wait, holder=self.holder)
                failures = 0
                if self._keep(lease):
                    if not self._stopping.is_set():
                        self._report(lease, lost, troubled, started)
                    return
            except UnknownResource:
                pass  # the invalid resource was removed before it could be quarantined
            except NoResourceAvailable:
                if due():
                    log.info("%s: pool %r exhausted, waiting (%.0fs so far)", self.name, self._pool.name,
                             time.monotonic() - started)
            except UnknownPool:
                if not background:
                    raise
                if due():
                    log.warning("%s: pool %r has no resources, waiting (%.0fs so far)", self.name,
                                self._pool.name, time.monotonic() - started)
                self._stopping.wait(self.interval)
            except Error as exc:
                transient = db.transient(exc)
                if not (transient or background):
                    raise
                troubled = True
                if due():
                    what = "database unreachable" if transient else "database error"
                    log.warning("%s: %s (%s), retrying (%.0fs so far)", self.name, what, exc,
                                time.monotonic() - started)
                self._stopping.wait(db.backoff(failures, base=0.1, cap=self.interval))
                failures += 1

    def _keep(self, lease: Lease) -> bool:
        """Publish a lease just acquired if it is valid (True); quarantine it if not (False).
        A terminate() that came while it was acquired releases it (True: the search ends)."""
        with self._publish:
            stopped = self._stopping.is_set()
            if not stopped:
                self.lease = lease
        if stopped:
            self._let_go(lease, self._poll)
            return True
        reason = self._invalid()
        if reason is None:
            return True
        lease._mark_lost()  # abandoned whatever happens to the quarantine
        log.warning("%s: %s/%s is not valid, quarantining it", self.name, lease.pool, lease.name)
        self._pool.quarantine(lease.name, self.quarantine_for, reason=reason)
        return False

    def _report(self, lease: Lease, lost: Lease | None, troubled: bool, started: float) -> None:
        """Say a resource is held; at the level of the trouble it follows, if any."""
        if lost is not None:
            gap = time.monotonic() - min(lost.deadline, started)
            log.warning("%s: holding %s/%s again (token %s), %.1fs after %s/%s ran out or was lost",
                        self.name, lease.pool, lease.name, lease.token, gap, lost.pool, lost.name)
        else:
            log.log(logging.WARNING if troubled else logging.INFO, "%s: holding %s/%s (token %s)",
                    self.name, lease.pool, lease.name, lease.token)

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                lease = self.lease
                keep_alive(lease, self.interval, self._stopping)
                if self._stopping.is_set():
                    break
                with self._swap:
                    if self.lease is lease:  # lost, not replaced by fix(): take another
                        log.warning("%s: lost %s/%s, acquiring again", self.name, lease.pool, lease.name)
                        self._acquire(background=True, lost=lease)
        finally:
            connections.close_all()

    def fix(self) -> bool:
        """If the resource is invalid, release it and acquire another (blocking like
        start()). True if replaced."""
        with self._swap:
            if self.lease is None or self._invalid() is None:
                return False
            self._let_go(self.lease, self.lease.remaining())
            self._acquire(background=False)
            return True

    def terminate(self, timeout: float = 5.0) -> None:
        """Stop heartbeating and release the resource.

        Returns within about `timeout` seconds even while the database is down or hung: a
        lease it could not release in that time frees itself after `ttl`.
        """
        deadline = time.monotonic() + timeout
        with self._publish:
            self._stopping.set()
            lease = self.lease
        # Release first: it needs only the lease's lock, which a healthy heartbeat holds
        # for milliseconds; a renewal stuck in the database makes it time out and say so.
        if lease is not None:
            self._let_go(lease, timeout)
        if self.is_alive() and threading.current_thread() is not self:
            self.join(max(0.0, deadline - time.monotonic()))

    def _let_go(self, lease: Lease, seconds: float) -> None:
        """Release `lease` within `seconds`; failing is only a warning, as it frees itself."""
        try:
            release_within(lease, seconds)
        except (Error, TimeoutError) as exc:
            log.warning("%s: could not release %s (%s); it frees itself within %gs",
                        self.name, lease, exc, lease.ttl)
