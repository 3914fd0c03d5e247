"""The database connections a handler thread keeps from job to job.

A connection per job would cost more than a small job (3 to 11 ms to open on MariaDB), so
each thread keeps its connections, as a long-lived process does, whatever CONN_MAX_AGE
says. A kept connection can die between two jobs, or while a handler works before its
first statement: an outage, a server's restart, an administrator's kill, wait_timeout.
The handler's statement would then be the one to find out, and fail the job's attempt.
So, before each job (`before_job`), each connection the thread keeps is

- closed if its database lost a connection anywhere in this process since the thread's
  previous job (`leases.outages`): the worker's loop meets an outage at its next
  statement, before it hands out another job, and every connection went through it;
- pinged if it sat idle for IDLE_CHECK seconds (a drop no one heard of);
- otherwise looked at again when the job first uses it (a cursor, or a transaction's
  start), with no round trip, and replaced before the statement goes if its server
  closed it meanwhile (`outages.closed_by_peer`).

None of this sends a statement twice or runs a handler again: a statement that fails once
sent may have run, so its failure fails the attempt as any error does. After the job
(`after_job`) a connection is closed if it is broken, was left with autocommit changed, or
is older than CONN_MAX_AGE when that is set.
"""
from __future__ import annotations

import logging
import threading
import time

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from leases import outages

log = logging.getLogger("leases.tasks.worker")

#: Seconds a kept connection may sit idle before it is pinged before a job.
IDLE_CHECK = 30.0

#: Per thread: `outages.seen()` as its last job began.
_thread = threading.local()


def before_job() -> None:
    """Close the kept connections that went through an outage or sat idle too long and
    died; have the others checked at the job's first use of them."""
    earlier = getattr(_thread, "seen", {})
    _thread.seen = now = outages.seen()
    for connection in connections.all(initialized_only=True):
        if connection.connection is None:
            continue
        try:
            if now.get(connection.alias, 0) != earlier.get(connection.alias, 0):
                log.debug("thread %s: replacing its connection to %s, which went through an outage",
                          threading.current_thread().name, connection.alias)
                outages.close(connection)
            elif time.monotonic() - getattr(connection, "leases_used_at", 0.0) > IDLE_CHECK:
                if not connection.is_usable():
                    outages.close(connection)
            else:
                _check_at_first_use(connection)
        except Exception as exc:  # noqa: BLE001 - a dead connection is reopened on next use
            log.debug("checking a kept connection failed: %s", outages.one_line(exc))


def _check_at_first_use(connection: BaseDatabaseWrapper) -> None:
    """Before the job's first cursor or transaction on `connection`, close it if its server
    closed it, so that Django opens a new one for that statement.

    Django calls `close_if_health_check_failed()` at exactly those two moments, before it
    connects (its own check, with CONN_HEALTH_CHECKS, pings every time); the thread's own
    stands in front of it for one call, then lets Django's run."""

    def check() -> None:
        del connection.close_if_health_check_failed
        if not connection.in_atomic_block and outages.closed_by_peer(connection) and not connection.is_usable():
            log.debug("thread %s: its connection to %s was closed by the server; opening a new one",
                      threading.current_thread().name, connection.alias)
            outages.close(connection)
        connection.close_if_health_check_failed()

    connection.close_if_health_check_failed = check


def after_job() -> None:
    """Keep the thread's connections for the next job, but close any that is broken, was
    left with autocommit changed, or is older than CONN_MAX_AGE when that is set. Django's
    per-request rule (CONN_MAX_AGE = 0 closes after every request) would open a connection
    per job. Failures are no news."""
    for connection in connections.all(initialized_only=True):
        connection.__dict__.pop("close_if_health_check_failed", None)  # the job did not use it
        try:
            if connection.settings_dict["CONN_MAX_AGE"] == 0:
                connection.close_at = None  # lives across jobs, like a persistent connection
            connection.close_if_unusable_or_obsolete()
            connection.leases_used_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a dead connection is reopened on next use
            log.debug("tidying a connection failed: %s", outages.one_line(exc))
