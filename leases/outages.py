"""What an outage leaves behind: connections that died, dropped before the next unit of
work uses them, and a count of the connections each database lost in this process.

`leases.db.run` notes each connection it sees die under a statement or refused (`lost`).
A connection kept for later, such as a worker's handler thread's from job to job, is
replaced before its next use when the count of its database moved since it was last
known good (`seen`): every connection of a process goes through the same outage,
and the thread's own statement would otherwise be the one to find out, failing its job's
attempt. A connection that its server (or a proxy) closed is found without a round trip:
its socket has something to read while no statement awaits a reply (`closed_by_peer`).
"""
from __future__ import annotations

import logging
import select

from django.db.backends.base.base import BaseDatabaseWrapper

from .watchdog import _fileno

log = logging.getLogger("leases.db")

#: Connections lost so far, by database alias.
_lost: dict[str, int] = {}


def lost(alias: str) -> None:
    """Note that a connection to `alias` died or was refused."""
    _lost[alias] = _lost.get(alias, 0) + 1


def seen() -> dict[str, int]:
    """The connections each database lost so far in this process, by alias: a database
    whose count moved between two answers went through an outage in between."""
    return dict(_lost)


def closed_by_peer(connection: BaseDatabaseWrapper) -> bool:
    """Whether the server, or something between, closed this connection while it sat idle:
    its socket is readable though no statement awaits a reply (the end of the stream, or
    the error a server sends as it ends a session). One system call, no round trip; False
    where there is no socket (SQLite) or it cannot be told."""
    raw = connection.connection
    if raw is None or connection.vendor == "sqlite":
        return False
    try:
        poller = select.poll()
        poller.register(_fileno(raw), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except Exception as exc:  # noqa: BLE001 - cannot tell: the next statement finds out
        log.debug("checking a connection's socket failed: %s", one_line(exc))
        return False


def one_line(exc: BaseException) -> str:
    """An expected failure, for a DEBUG line: its type and first line, no traceback (the
    tracebacks in a log are kept for what nobody expected)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def drop_if_broken(connection: BaseDatabaseWrapper) -> None:
    """Close a connection on which a statement failed and that no longer answers.

    Django wraps the error of a statement (an ORM read too) and keeps the connection, which
    after an outage or a terminated session is dead: the next statement on it would fail
    again, with the driver's own error where Django does not wrap the call. One trivial
    query after a failure, none otherwise; never inside a caller's transaction."""
    if connection.connection is None or not connection.errors_occurred or connection.in_atomic_block:
        return
    try:
        usable = connection.is_usable()
    except Exception:  # noqa: BLE001 - a driver that cannot even tell: treat it as dead
        usable = False
    if usable:
        connection.errors_occurred = False
    else:
        close(connection)
        lost(connection.alias)


def close(connection: BaseDatabaseWrapper) -> None:
    """Drop a connection that died; closing it may fail too, and that is no news."""
    try:
        connection.close()
    except Exception as exc:  # noqa: BLE001 - Django forgets the connection either way
        log.debug("closing a dead connection failed: %s", one_line(exc))
