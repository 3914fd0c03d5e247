"""An operator's actions on jobs (the admin, `manage.py jobs`, and your code): retry what
ended badly, cancel what waits (and ask what runs to stop), discard what does not run.
Each goes by ids, in chunks; none ends an attempt a worker still runs: cancelling one is a
request its worker carries out."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Callable, Iterable, Sequence

from leases import db
from leases.sql import in_list

from .. import sql
from ..models import Job
from . import steps
from .outcomes import follow_ups

#: Ids per statement, well under the placeholder limits of MySQL and SQLite.
CHUNK = 500


def _by_chunks(ids: Sequence[int], act: Callable[[Any, Any, list[int]], int], using: str | None,
               locking: bool = True) -> int:
    """`act(cursor, statements, chunk)` for each CHUNK of `ids`, a transaction each (on
    SQLite an immediate one when it reads before it writes); the sum of what it returns."""
    ids = list(ids)
    done = 0
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]

        def work(cursor: Any, resumed: bool, chunk: list[int] = chunk) -> int:
            if not locking:
                return act(cursor, sql.jobs(cursor.db), chunk)
            with db.write_transaction(cursor.db.alias):
                return act(cursor, sql.jobs(cursor.db), chunk)

        done += db.run(work, using)
    return done


def cancel(ids: Sequence[int], using: str | None = None, running: bool = True) -> int:
    """Cancel waiting jobs, and ask running ones to stop (with `running`; their workers
    learn it at their next heartbeat, and the handler at its next step, sleep or wait, or
    is abandoned after the worker's grace); returns how many of both. The waiting rows
    are locked first, so their on_finish jobs are queued for exactly the rows cancelled."""
    asked = steps.request_cancel(ids, using) if running else 0
    return asked + _cancel_waiting(ids, using)


def _cancel_waiting(ids: Sequence[int], using: str | None) -> int:
    def act(cursor: Any, st: Any, chunk: list[int]) -> int:
        cursor.execute(st.cancellable + in_list(chunk) + db.for_update(cursor.db), chunk)
        rows = cursor.fetchall()
        if not rows:
            return 0
        doomed = [row[0] for row in rows]
        cursor.execute(st.cancel + in_list(doomed), doomed)
        count = cursor.rowcount
        follow_ups(cursor, rows)
        return count

    return _by_chunks(ids, act, using)


def retry(ids: Sequence[int], using: str | None = None) -> int:
    """Give failed, dead or cancelled jobs one more attempt, now; returns how many."""

    def act(cursor: Any, st: Any, chunk: list[int]) -> int:
        cursor.execute(st.run_again + in_list(chunk), chunk)
        return cursor.rowcount

    return _by_chunks(ids, act, using, locking=False)


def discard(ids: Sequence[int], using: str | None = None) -> int:
    """Delete jobs that are not running, with their errors; returns how many. A waiting
    job's on_finish job is queued (its handler finds the job gone).

    The deletable rows are locked first, so a job a worker claims meanwhile keeps its
    error history along with its row.
    """

    def act(cursor: Any, st: Any, chunk: list[int]) -> int:
        cursor.execute(st.discardable + in_list(chunk) + db.for_update(cursor.db), chunk)
        rows = cursor.fetchall()
        doomed = [row[0] for row in rows]
        if not doomed:
            return 0
        cursor.execute(st.delete_errors + in_list(doomed), doomed)
        steps.delete_with(cursor, doomed)
        cursor.execute(st.discard + in_list(doomed), doomed)
        count = cursor.rowcount
        follow_ups(cursor, [(job_id, queue, then) for job_id, status, queue, then in rows if status in Job.WAITING])
        return count

    return _by_chunks(ids, act, using)


def select_batches(
    status: int | str,
    queue: str | None = None,
    before: datetime | None = None,
    size: int = CHUNK,
    using: str | None = None,
) -> Iterable[list[int]]:
    """Ids of the jobs in `status` (a number or a name), `size` at a time in id order, for
    an operator's retry, cancel or discard by status; only those of `queue`, and with
    `before` only those that finished before it (or, not finished, were queued before it).

    Each batch is read after the caller acted on the one before, past its last id: a job
    the action sends back into `status` (a retried job that fails again at once) is not
    taken twice, so the walk ends however fast workers are.
    """
    jobs = Job.objects.using(db.alias(using)).filter(status=status).order_by("pk")
    if queue is not None:
        jobs = jobs.filter(queue=queue)
    if before is not None:
        ended = Job._meta.get_field("status").get_prep_value(status) in Job.FINISHED
        jobs = jobs.filter(**{"finished_at__lt" if ended else "enqueued_at__lt": before})
    last = 0
    while ids := list(jobs.filter(pk__gt=last).values_list("pk", flat=True)[:size]):
        yield ids
        last = ids[-1]
