"""ResourceThread: hold one resource for the life of a worker, heartbeating in the background."""
from __future__ import annotations

import logging
import threading
import time

from django.db import connections

from .exceptions import NoResourceAvailable
from .lease import Lease, keep_alive
from .pool import Pool

log = logging.getLogger("leases")


class ResourceThread(threading.Thread):
    """Base class of a worker's hold on one resource of `pool`.

    Subclass it, set `pool`, `ttl` and `interval` (default ttl/3), and override
    `is_valid()`. `start()` blocks until a valid resource is held (logging while the
    pool is exhausted), then the thread renews the lease every `interval`; when a
    renewal fails it acquires again. The current lease is `self.lease`: read it each
    time you use the resource, it changes after a loss or `fix()`.

    A process that dies stops heartbeating, and its resource frees itself after `ttl`.
    """

    pool: str = ""
    ttl: float = 60
    interval: float | None = None
    #: How long a resource that fails `is_valid()` stays out of service.
    quarantine_for: float = 86400
    #: How often a worker waiting on an exhausted pool says so in the log.
    wait_step: float = 5
    #: How soon a waiting start() notices terminate().
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

    def is_valid(self) -> bool:
        """Whether `self.lease`'s resource works (a proxy answers, an account logs in)."""
        return True

    def start(self) -> None:
        """Acquire a valid resource (blocking), then start heartbeating."""
        with self._swap:
            self._acquire()
        if self.lease is not None:
            super().start()

    def _acquire(self) -> None:
        """Replace self.lease with a valid resource; quarantine the invalid ones met."""
        started = time.monotonic()
        said = started - self.wait_step  # so the first failed attempt is reported
        while not self._stopping.is_set():
            try:
                lease = self._pool.acquire(ttl=self.ttl, wait=min(self._poll, self.wait_step), holder=self.holder)
            except NoResourceAvailable:
                if time.monotonic() - said >= self.wait_step:
                    said = time.monotonic()
                    log.info("%s: pool %r exhausted, waiting (%.0fs so far)", self.name, self._pool.name,
                             said - started)
                continue
            self.lease = lease
            if self.is_valid():
                log.info("%s: holding %s/%s (token %s)", self.name, lease.pool, lease.name, lease.token)
                return
            log.warning("%s: %s/%s is not valid, quarantining it", self.name, lease.pool, lease.name)
            self._pool.quarantine(
                lease.name, self.quarantine_for, reason=f"{type(self).__name__}.is_valid() returned False"
            )
        self.lease = None

    def run(self) -> None:
        try:
            while not self._stopping.is_set() and self.lease is not None:
                lease = self.lease
                keep_alive(lease, self.interval, self._stopping)
                if self._stopping.is_set():
                    break
                with self._swap:
                    if self.lease is lease:  # lost, not replaced by fix(): take another
                        log.warning("%s: lost %s/%s, acquiring again", self.name, lease.pool, lease.name)
                        self._acquire()
        finally:
            connections.close_all()

    def fix(self) -> bool:
        """If the resource is invalid, release it and acquire another. True if replaced."""
        with self._swap:
            if self.lease is None or self.is_valid():
                return False
            self.lease.release()
            self._acquire()
            return True

    def terminate(self) -> None:
        """Stop heartbeating and release the resource."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()
        with self._swap:
            if self.lease is not None:
                self.lease.release()
