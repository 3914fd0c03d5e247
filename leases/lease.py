"""Held leases and locks: renew them, release them, know how long they are still yours."""
from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.db import Error, connections

from . import db
from .exceptions import LeaseLost
from .models import HOLDER_LENGTH
from .sql import statements
from .validation import check_cooldown, check_ttl

log = logging.getLogger("leases")

_SUFFIX_LENGTH = 9  # ":" + 8 hex digits
#: The coarsest server clock supported (SQLite's) ticks in milliseconds and truncates, so
#: estimates of the server's expiry keep this much in hand.
_CLOCK_TICK = 0.001


@lru_cache(maxsize=1)
def _process_identity(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}"  # keyed by pid: a forked child gets its own


def make_holder(holder: str | None = None) -> str:
    """A holder string unique to one acquisition: `holder` (default host:pid) + ':random'.

    The random part makes the stored holder a per-acquisition token, so after a dropped
    connection the client can look its own claim up and know whether it committed.
    """
    if holder is None:
        holder = _process_identity(os.getpid())
    elif not isinstance(holder, str) or not holder.strip():
        raise ValueError("holder must be a non-empty string")
    if len(holder) > HOLDER_LENGTH - _SUFFIX_LENGTH:
        raise ValueError(f"holder is longer than {HOLDER_LENGTH - _SUFFIX_LENGTH} characters")
    return f"{holder}:{secrets.token_hex(4)}"


#: The holder of a lease a job of the queue holds: its worker, then ":job" and its id.
_JOB_HOLDER = re.compile(r"^(.*):job(\d+)$")


def job_holder(worker: str, job_id: int) -> str:
    """The holder written for the lease a running job holds (leases.tasks), by which the
    operators' views of a resource name the job."""
    return f"{worker}:job{job_id}"


def job_of(holder: str) -> tuple[str, int] | None:
    """(worker, job id) of a job's lease holder, or None for any other holder."""
    found = _JOB_HOLDER.match(holder)
    return (found[1], int(found[2])) if found else None


class Hold:
    """Exclusive hold on one row until `expires_at`, proven by `token`: a lease or a lock.

    `token` is the fencing token: it grows with every acquisition of the row, so a system
    that remembers the highest token it has seen can refuse a stale holder.
    `expires_at` and `remaining()` are a conservative estimate from the database clock
    read at acquisition plus the local monotonic clock; the server may keep the hold a
    little longer, never shorter. Subclasses name their `kind` of statements.
    """

    kind = ""

    def __init__(
        self,
        *,
        id: int,
        token: int,
        holder: str,
        ttl: float,
        sent_at: float,
        db_anchor: datetime,
        mono_anchor: float,
        using: str,
    ) -> None:
        self.id = id
        self.token = token
        self.holder = holder
        self.ttl = ttl
        self.using = using
        self.lost = False
        self.released = False
        self._deadline = sent_at + ttl - _CLOCK_TICK
        self._db_anchor = db_anchor
        self._mono_anchor = mono_anchor
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return f"{self.kind} #{self.id}"

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.released else "held"
        return f"<{type(self).__name__} {self} token={self.token} {state}>"

    @property
    def expires_at(self) -> datetime:
        """When it surely stops being yours unless renewed, as a database-clock time."""
        return self._db_anchor + timedelta(seconds=self._deadline - self._mono_anchor)

    @property
    def deadline(self) -> float:
        """The `time.monotonic()` moment until which it is surely ours, if not lost or released."""
        return self._deadline

    def remaining(self) -> float:
        """Seconds it is surely still ours (0 once lost or released)."""
        if self.lost or self.released:
            return 0.0
        return max(0.0, self._deadline - time.monotonic())

    def check(self) -> None:
        """Raise LeaseLost unless it is surely still held: call it between steps of work."""
        if self.remaining() <= 0:
            raise LeaseLost(f"{self} (token {self.token}) is no longer held")

    def renew(self, ttl: float | None = None) -> None:
        """Extend to `ttl` seconds from now (server clock); LeaseLost if it is gone."""
        ttl = self.ttl if ttl is None else check_ttl(ttl)
        with self._lock:
            if self.lost or self.released:
                raise LeaseLost(f"{self} (token {self.token}) is not held")
            sent_at = time.monotonic()

            def work(cursor: Any, resumed: bool) -> bool:
                sql = statements(cursor.db, self.kind).renew
                cursor.execute(sql, (db.dialect(cursor.db).seconds(ttl), self.id, self.token, self.holder))
                return cursor.rowcount == 1

            # Past its deadline it is not surely ours, renewed or not: wait no longer. A
            # renewal sent after it asks the server, whose clock decides, as any other.
            until = self._deadline if sent_at < self._deadline else None
            if not db.run(work, self.using, until=until):
                self.lost = True
                raise LeaseLost(f"{self} (token {self.token}) expired or passed to another holder")
            self.ttl = ttl
            self._deadline = sent_at + ttl - _CLOCK_TICK

    def release(self) -> bool:
        """Give it up now. False when it was no longer ours (nothing else is touched)."""
        with self._lock:
            if self.released:
                return False
            self.released = True
            if self.lost:
                return False

            def work(cursor: Any, resumed: bool) -> bool:
                cursor.execute(statements(cursor.db, self.kind).release, self._release_params(cursor))
                return cursor.rowcount == 1

            return db.run(work, self.using)

    def _release_params(self, cursor: Any) -> tuple:
        return (self.id, self.token, self.holder)

    def _mark_lost(self) -> None:
        with self._lock:
            self.lost = True


class Lease(Hold):
    """Exclusive use of one slot of a resource of a pool, as `Pool.acquire` returns it.

    `pool` and `name` name the resource, `resource` is its data (JSON), `slot` which of
    its slots (0 for a resource of one slot), `token` its fencing token, `holder` the
    holder string stored in its row. `remaining()` is how long it is surely yours,
    `check()` raises LeaseLost once it is not, `renew()` extends it and `release()`
    gives it up (see `Hold`).
    """

    kind = "resource"

    def __init__(self, *, pool: str, name: str, resource: Any, slot: int = 0, cooldown: float = 0.0,
                 **hold: Any) -> None:
        super().__init__(**hold)
        self.pool = pool
        self.name = name
        self.resource = resource
        self.slot = slot
        self.cooldown = cooldown

    def __str__(self) -> str:
        return f"lease on {self.pool}/{self.name}" + (f" slot {self.slot}" if self.slot else "")

    def release(self, cooldown: float | None = None) -> bool:
        """Give it up now; the slot rests `cooldown` seconds (default: the pool's) before
        anyone gets it again. False when it was no longer ours (nothing else is touched)."""
        if cooldown is not None:
            self.cooldown = check_cooldown(cooldown)
        return super().release()

    def _release_params(self, cursor: Any) -> tuple:
        return (db.dialect(cursor.db).seconds(self.cooldown), self.id, self.token, self.holder)

    def quarantine(self, seconds: float = 86400, reason: str = "") -> None:
        """Take this lease's slot out of service for `seconds` and give it up: a ban seen
        through this holding. It acts only while this holding is current (checked by the
        row's id, token and holder in one statement), so a verdict that arrives after the
        lease passed on cannot touch the next holder's; then it raises LeaseLost and
        changes nothing. The slot's token grows. `Pool.quarantine(name)` is the operator's
        action on the whole resource, whoever holds it."""
        seconds = check_ttl(seconds, "quarantine seconds")
        reason = str(reason)[:255]
        with self._lock:
            if self.released:
                raise LeaseLost(f"{self} (token {self.token}) was released: not quarantined")

            def work(cursor: Any, resumed: bool) -> bool:
                later = db.dialect(cursor.db).seconds(seconds)
                sql = statements(cursor.db)
                cursor.execute(sql.quarantine_held, (later, later, reason, self.id, self.token, self.holder))
                if cursor.rowcount == 1 or not resumed:
                    return cursor.rowcount == 1
                cursor.execute(sql.quarantined, (self.id, self.token + 1))  # the lost reply's
                return cursor.fetchone() is not None

            done = db.run(work, self.using)
            self.released = True
            if not done:
                self.lost = True
                raise LeaseLost(f"{self} (token {self.token}) is held by another holder now: not quarantined")


def keep_alive(lease: Hold, interval: float, stop: threading.Event) -> None:
    """Renew `lease` every `interval` seconds until `stop` is set or the lease is lost.

    A database error is survived while the lease still has time left; once the local
    deadline passes without a successful renewal the lease counts as lost.
    """
    while not stop.wait(interval):
        try:
            lease.renew()
        except LeaseLost:
            if not lease.released:  # released on purpose (fix(), exit) is no news
                log.warning("lost %s (token %s)", lease, lease.token)
            return
        except Error as exc:
            if lease.remaining() <= 0:
                lease._mark_lost()
                log.warning("%s ran out while renewal failed: %s", lease, db.one_line(exc))
                return
            log.warning("renewing %s failed, will retry: %s", lease, db.one_line(exc))


class Heartbeat(threading.Thread):
    """A daemon thread that keeps one lease or lock alive; closes its own connection on exit."""

    def __init__(self, lease: Hold, interval: float | None = None) -> None:
        super().__init__(name=f"heartbeat: {lease}", daemon=True)
        self.lease = lease
        self.interval = interval if interval is not None else lease.ttl / 3
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            keep_alive(self.lease, self.interval, self.stop_event)
        finally:
            connections.close_all()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing; wait at most `timeout` seconds for the thread to end, since a
        renewal in flight can be stuck in a database that stopped answering."""
        self.stop_event.set()
        self.join(max(0.0, timeout))


def release_within(hold: Hold, seconds: float, cooldown: float | None = None) -> bool:
    """Release `hold`, waiting at most `seconds` (and never past its local deadline); a
    lease's slot then rests `cooldown` seconds (default: its pool's).

    A process that is ending must not hang on a database that is down or stopped
    answering, and a hold that is not released frees itself when its ttl runs out. So a
    hold that has already run out locally is not sent at all, and the release runs in a
    helper thread (it waits for `Hold._lock` while a renewal is stuck, then for the
    database) that is left to finish on its own when time is up. True when released;
    False when it was no longer ours or has run out; TimeoutError when the database did
    not answer in time; the database's own error when it failed.
    """
    # Not remaining(), which reads 0 as soon as another thread has begun to release it: a
    # caller that returned at once could end its process before that release was sent.
    # The helper below waits for it on Hold._lock instead.
    left = 0.0 if hold.lost else hold._deadline - time.monotonic()
    if left <= 0:
        return False
    wait = max(0.0, min(seconds, left))
    outcome: list[Any] = []

    def release() -> None:
        try:
            outcome.append(hold.release() if cooldown is None else hold.release(cooldown))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(exc)
        finally:
            connections.close_all()  # this thread's own connection

    helper = threading.Thread(target=release, name=f"release: {hold}", daemon=True)
    helper.start()
    helper.join(wait)
    if not outcome:
        raise TimeoutError(f"no answer from the database within {wait:.1f}s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
