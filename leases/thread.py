"""ResourceThread: hold one resource for the life of a worker, heartbeating in the background."""
from __future__ import annotations

import logging
import math
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from django.db import Error, connections

from . import db
from .exceptions import LeaseLost, NoResourceAvailable, UnknownPool, UnknownResource
from .lease import Lease, keep_alive, release_within
from .pool import Pool

log = logging.getLogger("leases")

#: Signals that end a wait in start() on the main thread, then reach the process's own handler.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def same_holding(lease: Lease | None, other: Lease) -> bool:
    """Whether two leases are one holding: one slot's row, at one token."""
    return lease is not None and (lease.id, lease.token) == (other.id, other.token)


class ResourceThread(threading.Thread):
    """Base class of a worker's hold on one resource of `pool`.

    Subclass it, set `pool`, `ttl` and `interval` (default ttl/3), and override
    `is_valid()`. `start()` blocks until a valid resource is held (logging while the
    pool is exhausted or the database unreachable), then the thread renews the lease
    every `interval`; when the lease is lost it acquires again, for as long as it takes.
    The current lease is `self.lease`: read it each time you use the resource, it
    changes after a loss, `replace()` or `fix()`. Override `on_acquired`, `on_lost` and
    `on_replaced` to hear of those changes. The thread is named after its pool, then
    after the resource it holds.

    Between a loss and the next acquisition `self.lease` stays the lost lease, so code
    that reads it keeps working and learns the truth from it: `check()` raises LeaseLost
    and `remaining()` is 0. It is None only before the first acquisition.

    A process that dies stops heartbeating, and its resource frees itself after `ttl`.
    """

    pool: str = ""
    ttl: float = 60
    interval: float | None = None
    #: Serve waiters in the order they came (see `Pool.acquire`).
    fair: bool = False
    #: How long a resource that fails `is_valid()` stays out of service.
    quarantine_for: float = 86400
    #: How often a waiting worker (exhausted pool, database down) says so in the log.
    wait_step: float = 5
    holder: str | None = None

    def __init__(
        self,
        pool: str | Pool | None = None,
        ttl: float | None = None,
        interval: float | None = None,
        holder: str | None = None,
        name: str | None = None,
        fair: bool | None = None,
    ) -> None:
        self._pool = pool if isinstance(pool, Pool) else Pool(pool or self.pool)
        super().__init__(name=name or self._pool.name, daemon=True)
        self._named = name is not None
        self.ttl = ttl if ttl is not None else self.ttl
        self.interval = interval if interval is not None else (self.interval or self.ttl / 3)
        self.holder = holder if holder is not None else self.holder
        self.fair = fair if fair is not None else self.fair
        self.lease: Lease | None = None
        self._stopping = threading.Event()
        # Set when self.lease changes or the thread stops: the heartbeat moves on at once.
        self._switch = threading.Event()
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

    def on_acquired(self, lease: Lease) -> None:
        """Called (on the thread that acquired it) when a valid lease is held: the first,
        and each one taken after a loss."""

    def on_lost(self, lease: Lease) -> None:
        """Called on the heartbeat thread when `lease` ran out or passed to another
        holder, before another is sought."""

    def on_replaced(self, old: Lease, new: Lease) -> None:
        """Called (on the thread that asked) when `replace()` or `fix()` swapped `old` for `new`."""

    def start(self, timeout: float | None = None) -> None:
        """Acquire a valid resource, blocking through an exhausted pool and database
        outages, then start heartbeating.

        With `timeout`, NoResourceAvailable if none is held by then. What waiting cannot
        cure is raised here: UnknownPool, or a database error that is not an outage (a
        missing table, bad credentials). If terminate() is called meanwhile, or (on the
        main thread) SIGTERM or SIGINT arrives, it returns without starting the thread;
        the signal then reaches the handler the process had.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._signals_stop(), self._swap:
            self._acquire(background=False, deadline=deadline)
        if self.lease is not None and not self._stopping.is_set():
            super().start()

    @contextmanager
    def _signals_stop(self) -> Iterator[None]:
        """On the main thread, let SIGTERM and SIGINT end the wait, then pass them on."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        came: list[int] = []

        def stop(signum: int, frame: object) -> None:
            came.append(signum)  # only events here: the interrupted code may hold a lock
            self._stopping.set()
            self._switch.set()

        before = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
        if came:
            log.warning("%s: %s while waiting for a resource of pool %r: stopping", self.name,
                        signal.Signals(came[0]).name, self._pool.name)
            self.terminate()  # releases a lease published as the signal came
            handler = before[came[0]]
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(came[0])

    def _invalid(self) -> str | None:
        """None if `self.lease`'s resource is valid, else why not."""
        try:
            if self.is_valid():
                return None
            return f"{type(self).__name__}.is_valid() returned False"
        except Exception as exc:  # the user's check failing must not end the thread
            log.warning("%s: is_valid() raised on %s: %s", self.name, self.lease, db.one_line(exc))
            return f"{type(self).__name__}.is_valid() raised {type(exc).__name__}: {exc}"

    def _acquire(self, background: bool, lost: Lease | None = None, deadline: float | None = None) -> Lease | None:
        """Put a valid lease in self.lease and return it, trying until one is held,
        terminate() is called (None) or `deadline` passes (NoResourceAvailable).

        An exhausted pool and database outages are waited out (with backoff), saying so
        in the log at most every `wait_step` seconds; invalid resources are quarantined.
        In the background nothing ends the search but terminate(): an emptied pool or a
        database error that is no outage is logged and tried again, since a dead thread
        would leave the worker without a resource for good. `lost`: the lease this one
        replaces, for the log line."""
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
                lease = self._pool.acquire(ttl=self.ttl, wait=self._wait(deadline), holder=self.holder,
                                           fair=self.fair, stop=self._stopping)
                failures = 0
                if self._keep(lease):
                    if self._stopping.is_set():
                        return None
                    self._report(lease, lost, troubled, started)
                    return lease
            except UnknownResource:
                pass  # the invalid resource was removed before it could be quarantined
            except NoResourceAvailable:
                if deadline is not None and time.monotonic() >= deadline:
                    raise NoResourceAvailable(f"no free resource in pool {self._pool.name!r} within "
                                              f"{time.monotonic() - started:.1f}s") from None
                if due() and not self._stopping.is_set():
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
        return None

    def _wait(self, deadline: float | None) -> float:
        """How long one acquire may wait: a fair waiter keeps its place in line for the
        whole wait; others come back every `wait_step` to say they still wait."""
        step = 86400.0 if self.fair else self.wait_step
        return step if deadline is None else max(0.0, min(step, deadline - time.monotonic()))

    def _keep(self, lease: Lease) -> bool:
        """Publish a lease just acquired if it is valid (True); quarantine it if not (False).
        A terminate() that came while it was acquired releases it (True: the search ends)."""
        with self._publish:
            stopped = self._stopping.is_set()
            if not stopped:
                self.lease = lease
                if not self._named:
                    self.name = f"{lease.pool}/{lease.name}"
        if stopped:
            self._let_go(lease, 5.0)  # bounded: a hung database must not hold start() long
            return True
        reason = self._invalid()
        if reason is None:
            return True
        log.warning("%s: %s/%s is not valid, quarantining it", self.name, lease.pool, lease.name)
        self._ban(lease, self.quarantine_for, reason)
        return False

    def _ban(self, lease: Lease, seconds: float, reason: str) -> None:
        """Quarantine what this holding holds; a holding already gone is left alone."""
        try:
            lease.quarantine(seconds, reason)
        except LeaseLost as exc:
            log.warning("%s: %s", self.name, exc)
        except Error as exc:
            lease._mark_lost()  # abandoned: it frees itself after its ttl
            log.warning("%s: could not quarantine %s (%s); it frees itself within %gs",
                        self.name, lease, db.one_line(exc), lease.ttl)

    def _report(self, lease: Lease, lost: Lease | None, troubled: bool, started: float) -> None:
        """Say a resource is held, at the level of the trouble it follows, if any; tell on_acquired."""
        if lost is not None:
            gap = time.monotonic() - min(lost.deadline, started)
            log.warning("%s: holding %s/%s again (token %s), %.1fs after %s/%s ran out or was lost",
                        self.name, lease.pool, lease.name, lease.token, gap, lost.pool, lost.name)
        else:
            log.log(logging.WARNING if troubled else logging.INFO, "%s: holding %s/%s (token %s)",
                    self.name, lease.pool, lease.name, lease.token)
        self._tell(self.on_acquired, lease)

    def _tell(self, hook, *leases: Lease) -> None:
        """Call one of the on_* hooks; its failure is a log line, never the thread's end."""
        try:
            hook(*leases)
        except Exception as exc:  # the user's hook must not end the heartbeat
            log.warning("%s: %s raised %s", self.name, hook.__name__, db.one_line(exc))

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._switch.clear()
                lease = self.lease
                keep_alive(lease, self.interval, self._switch)
                if self._stopping.is_set():
                    break
                with self._swap:
                    if self.lease is lease and not self._switch.is_set():  # lost, not replaced: take another
                        log.warning("%s: lost %s/%s, acquiring again", self.name, lease.pool, lease.name)
                        self._tell(self.on_lost, lease)
                        self._acquire(background=True, lost=lease)
        finally:
            connections.close_all()

    def replace(self, quarantine: float | None = None, reason: str = "", cooldown: float | None = None,
                of: Lease | None = None, wait: float | None = None) -> Lease | None:
        """Give up the current resource and take another at once (blocking like start()).

        With `quarantine`, the resource is banned for that many seconds with `reason`,
        only if this holding is still current (see `Lease.quarantine`); otherwise it is
        released to rest `cooldown` seconds (default: the pool's). The new lease is
        renewed `interval` after it was taken. With `of`, only if the current lease is
        still that one (same id and token): a late verdict on a lease already replaced
        leaves the new one alone. With `wait`, NoResourceAvailable if no other is held
        within that many seconds (the thread goes on seeking one, as after a loss).
        Returns the lease now held (None if terminate() came).
        """
        deadline = None if wait is None else time.monotonic() + wait
        with self._swap:
            old = self.lease
            if of is not None and not same_holding(old, of):
                return old
            if old is not None:
                if quarantine is not None:
                    log.warning("%s: quarantining %s/%s for %gs: %s", self.name, old.pool, old.name, quarantine,
                                reason or "replaced")
                    self._ban(old, quarantine, reason)
                else:
                    self._let_go(old, old.remaining(), cooldown)
            try:
                new = self._acquire(background=False, deadline=deadline)
            finally:
                self._switch.set()  # the heartbeat leaves the old lease: for the new one, or to seek one
        if old is not None and new is not None:
            self._tell(self.on_replaced, old, new)
        return new

    def fix(self) -> bool:
        """If the resource is invalid, quarantine it (`quarantine_for`) and acquire
        another (blocking like start()). True if replaced."""
        if self.lease is None:
            return False
        reason = self._invalid()
        if reason is None:
            return False
        self.replace(quarantine=self.quarantine_for, reason=reason)
        return True

    def terminate(self, timeout: float = 5.0) -> None:
        """Stop heartbeating and release the resource; a wait for a free one ends too.

        Returns within about `timeout` seconds even while the database is down or hung: a
        lease it could not release in that time frees itself after `ttl`.
        """
        deadline = time.monotonic() + timeout
        with self._publish:
            self._stopping.set()
            self._switch.set()
            lease = self.lease
        # Release first: it needs only the lease's lock, which a healthy heartbeat holds
        # for milliseconds; a renewal stuck in the database makes it time out and say so.
        if lease is not None:
            self._let_go(lease, timeout)
        if self.is_alive() and threading.current_thread() is not self:
            self.join(max(0.0, deadline - time.monotonic()))

    def _let_go(self, lease: Lease, seconds: float, cooldown: float | None = None) -> None:
        """Release `lease` within `seconds`; failing is only a warning, as it frees itself."""
        try:
            release_within(lease, seconds, cooldown)
        except (Error, TimeoutError) as exc:
            log.warning("%s: could not release %s (%s); it frees itself within %gs",
                        self.name, lease, exc, lease.ttl)
