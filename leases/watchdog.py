"""A read deadline for the engine's work, which PostgreSQL's driver lacks.

libpq has no read timeout, and neither TCP keepalives nor tcp_user_timeout fire while a
server is stopped (SIGSTOP, a frozen VM): its kernel still acknowledges every packet. A
worker or a lease's heartbeat waiting for such a server would wait until it wakes. So each
unit of work `leases.db.run` sends registers a deadline here, and one thread per process
shuts down the socket of a connection whose unit is still waiting when its deadline
passes. The blocked call then fails with a lost connection, which `run` already retries
on a new connection: through a multi-host URL, on whichever server takes writes now.

The deadline is the database entry's LEASES_READ_TIMEOUT (`leases.conf.read_timeout`),
or sooner where the caller says the work is worthless after a moment (a lease's renewal
after the lease ran out). MySQL's driver has a read timeout of its own; there only such
callers' deadlines need the watchdog. SQLite has no socket to cut.

The thread starts with the first deadline and ends when none has come for a while, and
before a fork: a forked child never inherits it, and Python 3.12+ sees no thread to warn
about.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from . import conf

log = logging.getLogger("leases.db")

#: Seconds the thread lingers with nothing to watch before it ends.
IDLE = 5.0


class Watch:
    """One unit of work in flight: its connection, its deadline, its thread's name, and
    the driver's connection and socket as the unit began (mysqlclient answers `fileno()`
    on the thread using the connection only)."""

    __slots__ = ("connection", "fd", "raw", "thread", "timeout", "until")

    def __init__(self, connection: BaseDatabaseWrapper, until: float, timeout: float) -> None:
        self.connection = connection
        self.until = until
        self.timeout = timeout
        self.thread = threading.current_thread().name
        self.raw = connection.connection
        self.fd = _fileno(self.raw) if self.raw is not None else -1


class _Watchdog:
    """The watches of this process and the thread that cuts the overdue ones."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Nothing watched, no thread: a forked child's state (its parent's threads are gone)."""
        self.lock = threading.Condition(threading.Lock())
        self.watches: set[Watch] = set()
        self.thread: threading.Thread | None = None
        self.wake_at = 0.0  # when the thread looks next; 0.0: it is not running
        self.stopping = False

    def add(self, watch: Watch) -> None:
        with self.lock:
            self.watches.add(watch)
            if self.thread is None:
                self.stopping = False
                self.wake_at = watch.until
                self.thread = threading.Thread(target=self._run, name="leases read deadline", daemon=True)
                self.thread.start()
            elif watch.until < self.wake_at:
                self.lock.notify()

    def discard(self, watch: Watch) -> None:
        with self.lock:
            self.watches.discard(watch)

    def stop(self) -> None:
        """End the thread (before a fork); the next watch starts another."""
        with self.lock:
            thread, self.stopping = self.thread, True
            self.lock.notify()
        if thread is not None:
            thread.join(2.0)

    def restart(self) -> None:
        """After a fork, in the parent: watch again what was in flight."""
        with self.lock:
            waiting = list(self.watches)
            self.watches.clear()
        for watch in waiting:
            self.add(watch)

    def _run(self) -> None:
        idle_since = time.monotonic()
        with self.lock:
            while not self.stopping:
                now = time.monotonic()
                overdue = [watch for watch in self.watches if watch.until <= now]
                for watch in overdue:
                    self.watches.discard(watch)
                    _cut(watch)
                if self.watches:
                    idle_since = now
                    self.wake_at = min(watch.until for watch in self.watches)
                elif now - idle_since >= IDLE:
                    break
                else:
                    self.wake_at = idle_since + IDLE
                self.lock.wait(max(0.0, self.wake_at - time.monotonic()))
            self.thread, self.wake_at = None, 0.0


_dog = _Watchdog()


def watch(connection: BaseDatabaseWrapper, until: float | None = None) -> Watch | None:
    """Watch a unit of work about to run on `connection` (None: nothing to watch): its
    deadline is LEASES_READ_TIMEOUT from now, or `until` (a `time.monotonic()` moment)
    if sooner. Pass the result to `done()` when the unit ends, however it ends."""
    try:
        timeout = connection._leases_read_timeout
    except AttributeError:
        timeout = _timeout(connection)
    if timeout is False or (timeout is None and until is None):
        return None
    now = time.monotonic()
    deadline = now + timeout if timeout is not None else until
    if until is not None and until < deadline:
        deadline = until
    found = Watch(connection, deadline, deadline - now)
    _dog.add(found)
    return found


def done(found: Watch | None) -> None:
    """The unit `found` watches has ended: its connection is never cut for it."""
    if found is not None:
        _dog.discard(found)


def late(until: float | None) -> bool:
    """Whether the moment `until` (None: never) has passed."""
    return until is not None and time.monotonic() >= until


def _timeout(connection: BaseDatabaseWrapper) -> float | bool | None:
    """The connection's read timeout (False: no socket to cut), kept on the connection
    object (one per thread and database) so that each unit reads an attribute."""
    if connection.vendor == "sqlite":
        timeout: float | bool | None = False
    else:
        try:
            timeout = conf.read_timeout(connection.settings_dict, connection.vendor)
        except ValueError:  # leases.E016 says why; meanwhile the default
            timeout = conf.read_timeout({}, connection.vendor)
    connection._leases_read_timeout = timeout
    return timeout


def _fileno(raw: Any) -> int:
    """The socket of a driver's connection: psycopg 3's, psycopg2's or mysqlclient's."""
    pgconn = getattr(raw, "pgconn", None)
    return pgconn.socket if pgconn is not None else raw.fileno()


def _socket(watch: Watch) -> int:
    """The socket the unit waits on: the one it began with, or the one it opened since
    where the driver tells another thread (psycopg); -1 if none."""
    raw = watch.connection.connection
    if raw is None:
        return -1
    if raw is watch.raw:
        return watch.fd
    return raw.pgconn.socket if hasattr(raw, "pgconn") else -1


def _cut(watch: Watch) -> None:
    """Shut the socket down (on a duplicate of its descriptor, which the driver keeps):
    the call waiting on it fails at once with a lost connection."""
    try:
        fd = _socket(watch)
        if fd < 0:
            return
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except Exception as exc:  # noqa: BLE001 - a connection closed meanwhile: nothing left to cut
        log.debug("cutting a connection of %s failed: %s", watch.connection.alias, exc)
        return
    log.warning("database %s: no reply within %.1fs on thread %r: connection cut, the work is retried on a new one",
                watch.connection.alias, watch.timeout, watch.thread)


os.register_at_fork(before=_dog.stop, after_in_parent=_dog.restart, after_in_child=_dog.reset)
