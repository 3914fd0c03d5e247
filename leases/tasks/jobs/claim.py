"""The claim: a worker takes up to N due jobs of its queues, highest priority first, then
oldest run time, in one short transaction: ``SELECT ... FOR UPDATE SKIP LOCKED`` (SQLite:
an immediate transaction), the keys' limits decided (`limits`), then one UPDATE that
marks them running under the worker's name with a lease (`expires_at`) and counts the
claim (`claims`, the fence every outcome names).

Jobs whose handler needs a resource are claimed first, each together with a lease on one
(`leasing`), from their pool's lane of each queue; then the jobs that need none.

A claim whose reply was lost may have committed: before claiming more, the worker takes
back what runs under its name and it does not know of.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leases import db
from leases.encoding import load_json
from leases.sql import in_list

from .. import registry, sql
from ..joblease import JobLease
from . import leasing, limits

log = logging.getLogger("leases.tasks.worker")

#: A claim count's fence floor counts in steps of 2**20 per failover (`db.fence_floor`):
#: the column is a 32-bit integer, and no job is claimed a million times.
CLAIMS_BITS = 20


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
    #: What its backend's runner read for it in the claim's transaction (`read_ahead`).
    read: Any = None
    #: Set by the worker when the attempt timed out: its outcome is already written.
    abandoned: bool = False
    deadline: float | None = None
    #: A job that holds a resource: its pool, target and affinity keys, and the lease it
    #: was claimed with (see `leasing`).
    pool: str = ""
    target: str = ""
    affinity: str = ""
    lease: JobLease | None = None
    #: What its handler may take (`leases.tasks.context`), made when its attempt starts.
    context: Any = None
    #: The database it lives on; whether (and since when, monotonic) an operator asked its
    #: running attempt to stop (learnt at a heartbeat).
    using: str = ""
    cancel_requested: bool = False
    cancel_seen_at: float | None = None

    @property
    def limits(self) -> tuple[str, int | None, str]:
        """(limit key, concurrency, rate): what its end frees."""
        return self.limit_key, self.concurrency, self.rate


def _claimed(row: tuple, worker: str, taken: bool, lease: JobLease | None = None, using: str = "",
             floor: int = 0) -> ClaimedJob:
    """A row of "due" or "running_for"; `taken`: read after the claim, else before it
    (a claim made with the claims' fence `floor`)."""
    step = 0 if taken else 1
    return ClaimedJob(
        id=row[0], priority=row[1], queue=row[3], name=row[4], backend=row[5], payload=load_json(row[6]),
        attempt=row[7] + step, max_attempts=row[8], key=row[9], claims=row[10] if taken else max(row[10] + 1, floor),
        worker=worker,
        on_finish=row[11], limit_key=row[12], concurrency=row[13], rate=row[14], traceparent=row[15],
        pool=row[16], target=row[17], affinity=row[18], lease=lease, using=using,
    )


def _limits_of_row(row: tuple) -> tuple[str, int | None, str]:
    """(limit key, concurrency, rate) of a row of "due"."""
    return row[12], row[13], row[14]


def claim(worker: str, queues: list[str], limit: int, ttl: float, using: str, unsure: bool = False,
          known: frozenset[int] = frozenset(), skip: tuple[str, ...] = (),
          pools: Sequence[str] = (), first: Callable[[Any], None] | None = None,
          ) -> tuple[list[ClaimedJob], float | None]:
    """(up to `limit` due jobs of `queues`, claimed by `worker` for `ttl` seconds; seconds
    until the soonest job a rate delayed may start, or None).

    Jobs of `pools` first, each with a lease on a resource (`leasing`), then jobs that
    need none. `unsure`: an earlier claim may have committed unseen; then what runs
    under the worker's name and is not `known` (running or finished here) is taken back
    instead. `skip`: names of jobs to leave to other workers (handlers this one lacks:
    `handoff`). `first(cursor)`: statements to run at the start of the claim's
    transaction (a worker's last outcomes, `outcomes.Ending`), so both take one commit.
    """
    delayed: list[float | None] = [None]

    def work(cursor: Any, resumed: bool) -> list[ClaimedJob]:
        found = _take_back(cursor, worker, known, using) if resumed or unsure else []
        if found or not queues:
            if first is not None:
                with db.write_transaction(using):
                    first(cursor)
            return found
        claimed: list[ClaimedJob] = []
        with db.write_transaction(using):
            if first is not None:
                first(cursor)
            lanes = _Lanes(cursor, worker, ttl, skip, using, delayed)
            floor = lanes.floor
            for pool in pools:
                if len(claimed) < limit:
                    got = leasing.claim_pool(cursor, worker, pool, queues, limit - len(claimed), ttl, lanes)
                    claimed += [_claimed(row, worker, taken=False, lease=lease, using=using, floor=floor)
                                for row, lease in got]
            rows = _due(cursor, queues, limit - len(claimed), skip) if len(claimed) < limit else []
            rows = lanes.within_limits(rows)
            claimed += [_claimed(row, worker, taken=False, using=using, floor=floor) for row in lanes.start(rows)]
            read_ahead(cursor, claimed)
        return claimed

    return db.run(work, using), delayed[0]


def read_ahead(cursor: Any, claimed: list[ClaimedJob]) -> None:
    """Let each backend with a claim reader read what its jobs' runner needs, a statement
    per backend for the batch rather than one per job as each starts."""
    by_backend: dict[str, list[ClaimedJob]] = {}
    for job in claimed:
        if job.backend:
            by_backend.setdefault(job.backend, []).append(job)
    for backend, jobs in by_backend.items():
        reader = registry.claim_reader(backend)
        if reader is not None:
            reader(cursor, jobs)


class _Lanes:
    """The claim's steps, for the claim of a pool's jobs (`leasing.Lanes`) and its own."""

    def __init__(self, cursor: Any, worker: str, ttl: float, skip: tuple[str, ...], using: str,
                 delayed: list[float | None]) -> None:
        self.cursor, self.worker, self.ttl, self.skip, self.using, self.delayed = cursor, worker, ttl, skip, using, delayed
        #: The least claim count a claim writes (see `db.fence_floor`).
        self.floor = db.fence_floor(cursor.db, CLAIMS_BITS)

    def due(self, queue: str, pool: str, limit: int) -> list[tuple]:
        return _lane(self.cursor, queue, pool, limit, self.skip)

    def within_limits(self, rows: list[tuple]) -> list[tuple]:
        if not rows:
            return rows
        kept, soonest = limits.within_limits(self.cursor, rows, _limits_of_row, self.using)
        if soonest is not None:
            self.delayed[0] = soonest if self.delayed[0] is None else min(self.delayed[0], soonest)
        return kept

    def start(self, rows: list[tuple], leases: dict[int, JobLease] | None = None) -> list[tuple]:
        return _take(self.cursor, rows, self.worker, self.ttl, self.floor, leases)


def _take_back(cursor: Any, worker: str, known: frozenset[int], using: str) -> list[ClaimedJob]:
    """What runs under the worker's name that it does not know of (a lost claim reply)."""
    cursor.execute(sql.jobs(cursor.db).running_for, (worker,))
    found = [row for row in cursor.fetchall() if row[0] not in known]
    if found:
        log.warning("worker %s: took back %d job(s) claimed before a lost reply: %s", worker, len(found),
                    ", ".join(f"{row[4]} #{row[0]}" for row in found))
    return [_claimed(row, worker, taken=True, lease=leasing.lease_of(cursor, row, worker), using=using)
            for row in found]


def _due(cursor: Any, queues: list[str], limit: int, skip: tuple[str, ...] = ()) -> list[tuple]:
    """The first `limit` due rows of the queues' lanes of jobs that need no resource,
    together, in claim order, locked; none named in `skip`."""
    rows: list[tuple] = []
    for queue in queues:
        rows += _lane(cursor, queue, "", limit, skip)
    if len(queues) > 1:
        rows.sort(key=lambda row: (-row[1], str(row[2]), row[0]))
        rows = rows[:limit]
    return rows


def _lane(cursor: Any, queue: str, pool: str, limit: int, skip: tuple[str, ...]) -> list[tuple]:
    """The first `limit` due rows of one queue's lane of `pool` ("": of no pool), locked."""
    st = sql.jobs(cursor.db)
    if skip:
        cursor.execute(st.due_skipping + in_list(skip) + st.due_skipping_tail, (queue, pool, *skip, limit))
    else:
        cursor.execute(st.due, (queue, pool, limit))
    return cursor.fetchall()


def _take(cursor: Any, rows: list[tuple], worker: str, ttl: float, floor: int,
          leases: dict[int, JobLease] | None = None) -> list[tuple]:
    """Mark `rows` running under `worker`, with their `leases` (by job id) if they hold
    resources; the rows it won (all of them with SKIP LOCKED)."""
    if not rows:
        return []
    st = sql.jobs(cursor.db)
    ids = [row[0] for row in rows]
    later = db.dialect(cursor.db).seconds(ttl)
    if leases:
        statement, params = leasing.claim_statement(cursor, leases)
        cursor.execute(statement, (floor, worker, later, *params))
    else:
        cursor.execute(st.claim + in_list(ids), (floor, worker, later, *ids))
    if cursor.rowcount != len(ids):
        cursor.execute(st.claimed_among + in_list(ids), (worker, *ids))
        won = {row[0] for row in cursor.fetchall()}
        rows = [row for row in rows if row[0] in won]
    return rows
