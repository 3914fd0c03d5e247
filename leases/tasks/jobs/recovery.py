"""Leases on running attempts, and what happens when they lapse.

A worker's process row is a lease (`WorkerHold`) renewed by its heartbeat, and each
attempt it runs carries a lease (`Job.expires_at`) the same heartbeat extends, job by job.
When a worker stops heartbeating, any live worker puts its jobs back to ready (or dead,
when no attempt is left) with a WorkerLost error, and frees their keys' slots, in one
transaction; SKIP LOCKED keeps two recovering workers apart.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from leases import db
from leases.exceptions import WorkerLost
from leases.lease import Hold, make_holder
from leases.sql import in_list

from .. import sql
from . import handoff, limits
from .outcomes import describe, follow_ups

log = logging.getLogger("leases.tasks.worker")

#: Lapsed jobs recovered per statement batch.
RECOVER_BATCH = 100
#: Worker rows gone this long are deleted by live workers.
FORGET_AFTER = 86400.0


class WorkerHold(Hold):
    """A worker's process row, held as a lease and renewed by its heartbeat."""

    kind = "worker"

    def __str__(self) -> str:
        return f"worker {self.holder}"


def register_worker(queues: list[str], concurrency: int, ttl: float, using: str,
                    handlers: list[str] = ()) -> WorkerHold:
    """Insert a row for a new worker process, under a name of its own, and hold it; the
    row lists the `handlers` it can run (see `handoff`)."""
    holder = make_holder()
    sent_at = time.monotonic()

    def work(cursor: Any, resumed: bool) -> tuple:
        st = sql.workers(cursor.db)
        if not resumed:
            cursor.execute(st.register, (holder, holder, ",".join(queues), concurrency, handoff.dumps(list(handlers)),
                                         db.dialect(cursor.db).seconds(ttl)))
        cursor.execute(st.registered, (holder,))
        return cursor.fetchone()

    worker_id, now = db.run(work, using)
    return WorkerHold(id=worker_id, token=1, holder=holder, ttl=ttl, sent_at=sent_at, db_anchor=db.to_datetime(now),
                      mono_anchor=time.monotonic(), using=using)


def extend(worker: str, ids: list[int], ttl: float, using: str) -> None:
    """Extend the leases of the attempts `worker` runs (or finished and has yet to write),
    and no other: a claim it never heard back from lapses and is recovered."""
    if not ids:
        return

    def work(cursor: Any, resumed: bool) -> None:
        cursor.execute(sql.jobs(cursor.db).extend + in_list(ids), (db.dialect(cursor.db).seconds(ttl), worker, *ids))

    db.run(work, using)


def adopt(worker: str, old: str, using: str) -> None:
    """A worker whose own lease lapsed registered again as `worker`: keep the running
    jobs still under its `old` name (nobody recovered them)."""
    db.run(lambda cursor, resumed: cursor.execute(sql.jobs(cursor.db).adopt, (worker, old)), using)


def recover_lapsed(using: str, by: str, ids: list[int] | None = None, keep: set[int] | None = None,
                   worker: str = "") -> int:
    """Put back jobs whose worker stopped heartbeating (their lease lapsed, by the database
    clock): ready again, or dead when out of attempts, each with a WorkerLost error naming
    `by`; their keys' slots come back in the same transaction. `ids` limits it to those
    jobs (an operator's choice); `keep` are jobs of `worker` it still runs. Returns how many."""
    keep = keep or set()
    total, more = 0, True
    named: list[str] = []
    if ids is None:
        forget_workers(FORGET_AFTER, using)
    while more:
        count, more, names = db.run(_recoverer(using, by, ids, keep, worker), using)
        total += count
        named += names
    if total:
        log.warning("%s recovered %d job(s) whose worker stopped heartbeating: %s", by, total,
                    ", ".join(named[:20]) + (f" and {len(named) - 20} more" if len(named) > 20 else ""))
    return total


def _recoverer(using: str, by: str, ids: list[int] | None, keep: set[int], worker: str) -> Any:
    def work(cursor: Any, resumed: bool) -> tuple[int, bool, list[str]]:
        """(jobs recovered, whether a full batch was read and more may wait, their names)."""
        st = sql.jobs(cursor.db)
        named: list[str] = []
        freed = []
        with db.write_transaction(using):
            if ids is None:
                cursor.execute(st.lapsed, (RECOVER_BATCH,))
            else:
                cursor.execute(st.lapsed_among + in_list(ids), ids)
            lapsed = cursor.fetchall()
            for job_id, claims, attempt, owner, max_attempts, queue, on_finish, *limited, job_name in lapsed:
                if owner == worker and job_id in keep:
                    continue
                cursor.execute(st.recover, (job_id, claims))
                if cursor.rowcount != 1:
                    continue
                freed.append(tuple(limited))
                fate = "dead, out of attempts" if attempt >= max_attempts else "ready again"
                named.append(f"{job_name} #{job_id} of {owner} ({fate})")
                message = f"worker {owner} stopped heartbeating; recovered by {by}"
                cursor.execute(st.record_error, (job_id, attempt, *describe(WorkerLost(message))[:2], "", owner))
                if attempt >= max_attempts:  # dead: it ended for good
                    follow_ups(cursor, [(job_id, queue, on_finish)])
            limits.free_slots(cursor, freed, using)  # a crashed worker's slots come back now
        return len(freed), ids is None and len(lapsed) == RECOVER_BATCH and len(freed) > 0, named

    return work


def forget_workers(older_than: float, using: str | None = None) -> int:
    """Delete the rows of workers gone (stopped, or their heartbeat lapsed) for more than
    `older_than` seconds, by the database clock; live workers do this after a day."""

    def work(cursor: Any, resumed: bool) -> int:
        cursor.execute(sql.workers(cursor.db).forget, (db.dialect(cursor.db).seconds(-older_than),))
        return cursor.rowcount

    return db.run(work, using)
