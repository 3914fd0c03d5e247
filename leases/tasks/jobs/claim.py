"""The claim: a worker takes up to N due jobs of its queues, highest priority first, then
oldest run time, in one short transaction: ``SELECT ... FOR UPDATE SKIP LOCKED`` (SQLite:
an immediate transaction), the keys' limits decided (`limits`), then one UPDATE that
marks them running under the worker's name with a lease (`expires_at`) and counts the
claim (`claims`, the fence every outcome names).

A claim whose reply was lost may have committed: before claiming more, the worker takes
back what runs under its name and it does not know of.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from leases import db
from leases.encoding import load_json
from leases.sql import in_list

from .. import sql
from . import limits

log = logging.getLogger("leases.tasks.worker")


@dataclass
class ClaimedJob:
    """One attempt a worker runs: what the handler needs and what fences the outcome."""

    id: int
    queue: str
    name: str
    backend: str
    payload: Any
    attempt: int
    max_attempts: int
    priority: int
    key: str
    #: The job's claim count at this claim: every outcome is written only if it still is.
    claims: int = 0
    worker: str = ""
    #: Handler of the job to queue when this one ends for good (Job.on_finish).
    on_finish: str = ""
    #: The key its limits count by, and the job's own limits (see `limits`).
    limit_key: str = ""
    concurrency: int | None = None
    rate: str = ""
    #: W3C trace context of its push: its run's span is a child of it (see tracing).
    traceparent: str | None = None
    #: What runs it (a handler, or an app's runner), found when it was claimed.
    handler: Any = None
    #: Set by the worker when the attempt timed out: its outcome is already written.
    abandoned: bool = False
    deadline: float | None = None

    @property
    def limits(self) -> tuple[str, int | None, str]:
        """(limit key, concurrency, rate): what its end frees."""
        return self.limit_key, self.concurrency, self.rate


def _claimed(row: tuple, worker: str, taken: bool) -> ClaimedJob:
    """A row of "due" or "running_for"; `taken`: read after the claim, else before it."""
    step = 0 if taken else 1
    return ClaimedJob(
        id=row[0], priority=row[1], queue=row[3], name=row[4], backend=row[5], payload=load_json(row[6]),
        attempt=row[7] + step, max_attempts=row[8], key=row[9], claims=row[10] + step, worker=worker,
        on_finish=row[11], limit_key=row[12], concurrency=row[13], rate=row[14], traceparent=row[15],
    )


def _limits_of_row(row: tuple) -> tuple[str, int | None, str]:
    """(limit key, concurrency, rate) of a row of "due"."""
    return row[12], row[13], row[14]


def claim(worker: str, queues: list[str], limit: int, ttl: float, using: str, unsure: bool = False,
          known: frozenset[int] = frozenset(), skip: tuple[str, ...] = ()) -> tuple[list[ClaimedJob], float | None]:
    """(up to `limit` due jobs of `queues`, claimed by `worker` for `ttl` seconds; seconds
    until the soonest job a rate delayed may start, or None).

    `unsure`: an earlier claim may have committed unseen; then what runs under the
    worker's name and is not `known` (running or finished here) is taken back instead.
    `skip`: names of jobs to leave to other workers (handlers this one lacks: `handoff`).
    """
    delayed: list[float | None] = [None]

    def work(cursor: Any, resumed: bool) -> list[ClaimedJob]:
        if resumed or unsure:
            found = _take_back(cursor, worker, known)
            if found:
                return found
        if not queues:
            return []
        with db.write_transaction(using):
            rows = _due(cursor, queues, limit, skip)
            if not rows:
                return []
            rows, delayed[0] = limits.within_limits(cursor, rows, _limits_of_row, using)
            return [_claimed(row, worker, taken=False) for row in _take(cursor, rows, worker, ttl)]

    return db.run(work, using), delayed[0]


def _take_back(cursor: Any, worker: str, known: frozenset[int]) -> list[ClaimedJob]:
    """What runs under the worker's name that it does not know of (a lost claim reply)."""
    cursor.execute(sql.jobs(cursor.db).running_for, (worker,))
    found = [row for row in cursor.fetchall() if row[0] not in known]
    if found:
        log.warning("worker %s: took back %d job(s) claimed before a lost reply: %s", worker, len(found),
                    ", ".join(f"{row[4]} #{row[0]}" for row in found))
    return [_claimed(row, worker, taken=True) for row in found]


def _due(cursor: Any, queues: list[str], limit: int, skip: tuple[str, ...] = ()) -> list[tuple]:
    """The first `limit` due rows of the queues together, in claim order, locked; none
    named in `skip`."""
    st = sql.jobs(cursor.db)
    rows: list[tuple] = []
    for queue in queues:
        if skip:
            cursor.execute(st.due_skipping + in_list(skip) + st.due_skipping_tail, (queue, *skip, limit))
        else:
            cursor.execute(st.due, (queue, limit))
        rows += cursor.fetchall()
    if len(queues) > 1:
        rows.sort(key=lambda row: (-row[1], str(row[2]), row[0]))
        rows = rows[:limit]
    return rows


def _take(cursor: Any, rows: list[tuple], worker: str, ttl: float) -> list[tuple]:
    """Mark `rows` running under `worker`; the rows it won (all of them with SKIP LOCKED)."""
    if not rows:
        return []
    st = sql.jobs(cursor.db)
    ids = [row[0] for row in rows]
    cursor.execute(st.claim + in_list(ids), (worker, db.dialect(cursor.db).seconds(ttl), *ids))
    if cursor.rowcount != len(ids):
        cursor.execute(st.claimed_among + in_list(ids), (worker, *ids))
        won = {row[0] for row in cursor.fetchall()}
        rows = [row for row in rows if row[0] in won]
    return rows
