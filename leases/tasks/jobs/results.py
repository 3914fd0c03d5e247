"""Waiting for a job's result: `wait(job, timeout)` returns what its handler returned once
it succeeded, and raises `JobFailed` if it ended otherwise; an id that names no job is
the caller's mistake, `Job.DoesNotExist` ("no job #N", as `manage.py jobs wait` says).

On PostgreSQL the transaction that ends jobs notifies channel `leases_done` with their ids
(`announce_ended`), and a waiter listens on its own connection: it learns the end at once.
Elsewhere, and whenever a notification could be missed, it reads the job's status at
growing intervals (20 ms to a quarter of a second): one primary-key read each.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from django.db import connections

from leases import db
from leases.exceptions import JobFailed
from leases.validation import check_seconds

from ..models import Job

#: The channel on which the ends of jobs are announced (PostgreSQL).
CHANNEL = "leases_done"
#: Longest pause between two reads of a waited job's status.
POLL_CAP = 0.25
#: Largest id a job's key column holds.
MAX_ID = 2**63 - 1


def announce_ended(cursor: Any, job_ids: Iterable[int]) -> None:
    """Wake the waiters of these jobs when the transaction that ends them commits
    (PostgreSQL; elsewhere the waiters poll and `job_ids` is never run through)."""
    statement = db.dialect(cursor.db).notify
    ids = sorted({str(job_id) for job_id in job_ids}) if statement else []
    if ids:
        cursor.execute(statement, (CHANNEL, ids))


def wait(job: int | Job, timeout: float = 60.0, using: str | None = None) -> Any:
    """The result of the job (a Job or its id) once it succeeded, waiting up to `timeout`
    seconds; `JobFailed` if it failed, died, was cancelled or deleted; `TimeoutError` if it
    has not ended by then. An id that names no job when the wait begins raises
    `Job.DoesNotExist` ("no job #N"): it never existed, or was deleted before (a row
    leaves no trace to tell which); a Job's row gone then is "deleted", as it existed."""
    job_id = job.pk if isinstance(job, Job) else _job_id(job)
    using = db.alias(using) if not isinstance(job, Job) else (job._state.db or db.alias(using))
    deadline = time.monotonic() + check_seconds(timeout, "timeout")
    known = isinstance(job, Job)
    listener = _Listener(using)
    try:
        pause = 0.02
        while True:
            row = Job.objects.using(using).filter(pk=job_id).values_list("status", "result").first()
            if row is None and not known:
                raise Job.DoesNotExist(f"no job #{job_id}")
            if row is None:
                raise JobFailed(f"job #{job_id} was deleted", "deleted")
            known = True  # seen: if its row goes now, it was deleted while waited for
            status, result = row
            if status == Job.SUCCEEDED:
                return result  # decoded by the JSON field: a string result is the string
            if status in Job.FINISHED:
                label = dict(Job.STATUSES)[status]
                raise JobFailed(f"job #{job_id} {label}", label)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"job #{job_id} has not ended after {timeout:g}s")
            listener.wait(job_id, min(left, pause))
            pause = min(POLL_CAP, pause * 2)
    finally:
        listener.close()


def _job_id(value: Any) -> int:
    """A job's id as `wait` takes it; ValueError with one line for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_ID:
        raise ValueError(f"a job id is a whole number from 1 to {MAX_ID}, not {value!r}")
    return value


class _Listener:
    """A connection of the waiter's own that listens for ends of jobs, where the database
    notifies; elsewhere its `wait` only sleeps."""

    def __init__(self, using: str) -> None:
        self.connection = None
        if db.dialect(connections[using]).notify:
            connection = connections.create_connection(using)
            try:
                if db.listen(connection, CHANNEL):
                    self.connection = connection
                else:
                    connection.close()
            except Exception:  # noqa: BLE001 - no notifications: the waiter polls
                db.close(connection)

    def wait(self, job_id: int, seconds: float) -> None:
        if self.connection is None:
            time.sleep(seconds)
            return
        try:
            db.notifications(self.connection, seconds)  # any end wakes it; the status says which
        except Exception:  # noqa: BLE001 - a lost connection: poll from now on
            self.close()
            time.sleep(seconds)

    def close(self) -> None:
        if self.connection is not None:
            db.close(self.connection)
            self.connection = None
