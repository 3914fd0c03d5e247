"""Push: the only maker of job rows.

Whoever enqueues (`push`, a pipeline's stage, a schedule's tick, the Django Tasks
backend, the follow-up of a job that ended), the job is made by `new_job`, from the
settings of its handler (queue, attempts, limits; backoff and timeout are read from the
handler when it runs), and written by `write`, so a handler's settings apply whoever
enqueues it. A push is one upsert: a job whose key (default: a hash of name and payload)
is already waiting is not queued twice; it only takes the new run time (a
reschedule). The run time is the server clock plus the delay, computed in the statement.
A push inside a transaction is seen by workers when it commits; on PostgreSQL the
commit also wakes the workers listening for its queues (`announce`). A single push
costs one statement where an INSERT returns columns (`insert_one`): no transaction of
its own, no read-back.

Each push (a call of `push`, a batch of `push_many`) writes a random push id it chose into
the row it inserts (`push_id`) or merges into (`merged_push_id`). When the connection dies
under it, the push cannot know whether its statement ran; its retry looks for its own row
by that id among its key's rows (an index range read) and writes again only if none is
there. A look-up by the key's state instead once made a second job: the first had been
claimed meanwhile, so no job waited under its key.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import cache
from typing import Any, Callable, Iterable, Protocol, Sequence

from leases import db, routing
from leases.encoding import load_json
from leases.sql import in_list
from leases.validation import check_attempts, check_moment, check_queue, check_seconds

from .. import registry, sql, tracing
from ..models import Job
from ..needs import by_payload
from . import leasing, limits, queues
from .buffer import Buffer
from .payload import check_key, check_priority, default_key, dump_payload

log = logging.getLogger("leases.tasks")

#: The channel on which a commit of pushed jobs wakes listening workers; each
#: notification's payload is a queue's name.
CHANNEL = "leases_jobs"

#: Jobs per INSERT statement in push_many ...
BATCH = 1000
#: ... and at most this many characters of payload per statement (at most 4 bytes each),
#: well under MySQL's default max_allowed_packet of 16 MiB.
BATCH_CHARS = 2 << 20


class JobSettings(Protocol):
    """What a job takes from its handler when it is made: a `Handler`, or the settings a
    Django Tasks backend makes of its OPTIONS."""

    queue: str
    max_attempts: int
    limit_key: Any
    concurrency: int | None
    rate: str
    needs: Any


@dataclass(frozen=True)
class JobDefaults:
    """Settings for a job whose handler this process does not know (a follow-up, a
    scheduled job fired by a worker deployed without it): the worker that has the
    handler runs it."""

    queue: str = "default"
    max_attempts: int = 1
    limit_key: Any = None
    concurrency: int | None = None
    rate: str = ""
    needs: Any = None


@dataclass(frozen=True)
class NewJob:
    """A validated job, ready to be written: `delay` seconds from now, or at `run_at`."""

    queue: str
    name: str
    payload: str
    key: str
    priority: int
    max_attempts: int
    delay: float = 0.0
    run_at: datetime | None = None
    #: '' for a handler's job; else what runs it: a TASKS alias, or an app's runner.
    backend: str = ""
    #: Handler of the job queued when this one ends for good (see Job.on_finish).
    on_finish: str = ""
    #: The key its limits count by, and those limits (see leases.tasks.jobs.limits).
    limit_key: str = ""
    concurrency: int | None = None
    rate: str = ""
    #: W3C trace context its runs' spans are children of (see leases.tasks.tracing).
    traceparent: str | None = None
    #: The pool whose resource it holds while it runs, its target and affinity keys, and
    #: its turn among the pool's jobs, given when it is written (see leasing).
    pool: str = ""
    target: str = ""
    affinity: str = ""
    turn: int = 0

    @property
    def due_now(self) -> bool:
        """Pushed with no delay (or for a given moment): its queue's listeners are woken;
        a delayed job is left to the workers' polls."""
        return self.run_at is not None or not self.delay

    def params(self, connection: Any, push_id: int | None) -> list:
        head = [self.queue, self.name, self.backend, self.on_finish, self.payload, self.key, self.key, self.priority]
        head += [self.limit_key, self.concurrency, self.rate, self.max_attempts, self.traceparent]
        head += [self.pool, self.target, self.affinity, self.turn, push_id]
        if self.run_at is not None:
            return head + [db.dialect(connection).stored_datetime(self.run_at)]
        return head + [db.dialect(connection).seconds(self.delay)]

    def columns(self, connection: Any) -> tuple:
        """Its values for `insert_arrays`: a run time, or None and the delay."""
        at = None if self.run_at is None else db.dialect(connection).stored_datetime(self.run_at)
        return (self.queue, self.name, self.backend, self.on_finish, self.payload, self.key, self.priority,
                self.limit_key, self.concurrency, self.rate, self.max_attempts, self.traceparent, self.pool,
                self.target, self.affinity, self.turn, at, db.dialect(connection).seconds(self.delay))


def new_job(
    name: str,
    payload: Any = None,
    *,
    delay: float | timedelta = 0,
    run_at: datetime | None = None,
    queue: str | None = None,
    priority: int = 0,
    key: str | None = None,
    max_attempts: int | None = None,
    limit_key: str | None = None,
    concurrency: int | None = None,
    rate: str | None = None,
    settings: JobSettings | None = None,
    backend: str = "",
    on_finish: str = "",
    handler_payload: Callable[[], Any] | None = None,
    traceparent: str | None = None,
) -> NewJob:
    """The job `name` with `payload`, from its handler's `settings` (the registered handler
    of `name` unless given) and the options that override them; ValueError or
    UnknownHandler before anything is written.

    `handler_payload` makes what the handler will receive when that is not the payload
    stored (a pipeline task's: its item and its run's context): a `limit_key` that is a
    function of the payload is computed from it. The job carries `traceparent` (a
    pipeline task: its run's), else that of a push span when tracing is on.
    """
    settings = registry.get(name) if settings is None else settings
    text = dump_payload(payload)
    delay = check_seconds(delay, "delay")
    if run_at is not None:
        if delay:
            raise ValueError("give delay or run_at, not both")
        run_at = check_moment(run_at, "run_at")
    key_of = limit_key if limit_key is not None else settings.limit_key
    needs = getattr(settings, "needs", None)
    if by_payload(key_of, needs) and handler_payload is not None:
        payload = handler_payload()
    job = NewJob(
        queue=settings.queue if queue is None else check_queue(queue),
        name=name,
        payload=text,
        key=default_key(name, text) if key is None else check_key(key),
        priority=check_priority(priority),
        max_attempts=settings.max_attempts if max_attempts is None else check_attempts(max_attempts),
        delay=delay,
        run_at=run_at,
        backend=backend,
        on_finish=on_finish,
        limit_key=limits.key_of(key_of, payload),
        concurrency=settings.concurrency if concurrency is None else limits.check_concurrency(concurrency),
        rate=settings.rate if rate is None else limits.check_rate(rate),
    )
    if needs is not None:
        job = replace(job, pool=needs.pool, target=needs.target_of(payload), affinity=needs.affinity_of(payload))
    traceparent = traceparent if traceparent is not None else tracing.pushed(name, job.queue, job.key)
    return job if traceparent is None else replace(job, traceparent=traceparent)


# -- writing ----------------------------------------------------------------------------


def new_push_id() -> int:
    """A push's own id: random, 63 bits, so two pushes of one key never share one."""
    return secrets.randbits(63) or 1


def write(cursor: Any, jobs: Sequence[NewJob], ids: bool = False, push_id: int | None = None) -> dict[str, int]:
    """Write `jobs` with one upsert on the caller's cursor, in its transaction; a key met
    twice starts another upsert, since PostgreSQL refuses to merge into one row twice in
    one statement (MySQL and SQLite merge in order, which is what the split keeps). Rows
    go as VALUES groups, or on PostgreSQL as one array per column (`insert_arrays`). The
    rows carry `push_id` (None: a job made inside a caller's unit of work, which finds its
    own effects again by other means).

    With `ids`, returns {key: id} of the rows written (a job whose key merged into a
    waiting one: that one's id), from the upsert itself where an INSERT returns columns,
    else by a read of their keys; without, {}."""
    st = sql.jobs(cursor.db)
    if any(job.pool for job in jobs):
        jobs = leasing.take_turns(cursor, jobs)
    returning = ids and cursor.db.features.can_return_columns_from_insert
    tail = st.merge_waiting + (st.returning_ids if returning else "")
    found: dict[str, int] = {}
    for batch in _unique_keys(jobs):
        if db.dialect(cursor.db).arrays and len(batch) > 1:  # one row: VALUES costs less
            columns = [list(values) for values in zip(*(job.columns(cursor.db) for job in batch))]
            cursor.execute(st.insert_arrays + tail, [push_id, *columns])
        else:
            params: list = []
            rows = []
            for job in batch:
                rows.append(st.values_at if job.run_at is not None else st.values_after)
                params += job.params(cursor.db, push_id)
            cursor.execute(st.insert + ", ".join(rows) + tail, params)
        if returning:
            found.update(cursor.fetchall())
    announce(cursor, (job.queue for job in jobs if job.due_now))
    if ids and not returning:
        found = _ids_by_key(cursor, jobs)
    return found


def announce(cursor: Any, queue_names: Iterable[str]) -> None:
    """Wake the workers listening for these queues when the transaction commits: one
    notification per queue, however many jobs (PostgreSQL; elsewhere workers poll, and
    `queue_names`, a generator at the callers, is never run through)."""
    statement = db.dialect(cursor.db).notify
    names = sorted(set(queue_names)) if statement else []
    if names:
        cursor.execute(statement, (CHANNEL, names))


def _unique_keys(jobs: Sequence[NewJob]) -> list[list[NewJob]]:
    """`jobs` in order, cut into runs in which no key comes twice."""
    batches: list[list[NewJob]] = [[]]
    seen: set[str] = set()
    for job in jobs:
        if job.key in seen:
            batches.append([])
            seen.clear()
        batches[-1].append(job)
        seen.add(job.key)
    return batches


def _ids_by_key(cursor: Any, jobs: Sequence[NewJob]) -> dict[str, int]:
    """{key: id} of jobs just written in the caller's transaction."""
    keys = [job.key for job in jobs]
    cursor.execute(sql.jobs(cursor.db).ids_by_key + in_list(keys), keys)
    return dict(cursor.fetchall())


def insert(jobs: Sequence[NewJob], using: str | None = None, push_id: int | None = None,
           unsure: bool = False) -> None:
    """Write `jobs` with one upsert per batch (`write`), in a transaction of their own,
    under one push id (a new one unless given). After a try that may have committed (its
    connection died, or `unsure`: an earlier call with this id failed) any row of the
    batch found with its id means it did: all or none of a batch commits."""
    push_id = new_push_id() if push_id is None else push_id

    def work(cursor: Any, resumed: bool) -> None:
        if (resumed or unsure) and _batch_written(cursor, jobs, push_id):
            return
        with db.write_transaction(cursor.db.alias):
            write(cursor, jobs, push_id=push_id)

    db.run(work, using)


def _batch_written(cursor: Any, jobs: Sequence[NewJob], push_id: int) -> bool:
    """Whether a row of these jobs' keys carries `push_id`: a range read per key."""
    st = sql.jobs(cursor.db)
    keys = sorted({job.key for job in jobs})
    cursor.execute(st.pushed_among + in_list(keys) + st.pushed_among_tail, [push_id, push_id, *keys])
    return cursor.fetchone() is not None


def insert_one(job: NewJob, using: str, push_id: int) -> tuple:
    """Write one job; its row as the database holds it after the push (a new one, or the
    waiting one its key merged into).

    Where an INSERT returns columns (PostgreSQL, MariaDB, SQLite 3.35+) that is one
    statement, the upsert returning the row (and on PostgreSQL waking its queue): outside
    a caller's transaction it commits by itself, one round trip. Elsewhere, and for a job
    that takes its pool's turn (more statements), the upsert and a read of the row by key
    share a transaction, so no worker can claim it in between and hide it.

    If the connection died under an earlier try, the push may have committed: the row
    that carries its push id (new, or merged into; waiting, running or ended by now) is
    then its job, and only when none does is it written again.
    """

    def work(cursor: Any, resumed: bool) -> tuple:
        st = sql.jobs(cursor.db)
        if resumed and (row := _pushed_row(cursor, job, push_id)):
            return row
        if not job.pool and cursor.db.features.can_return_columns_from_insert:
            return _upsert_returning(cursor, st, job, push_id)
        with db.write_transaction(cursor.db.alias):
            write(cursor, [job], push_id=push_id)
            cursor.execute(st.waiting_by_key, (job.key,))
            return cursor.fetchone()

    return db.run(work, using)


def _upsert_returning(cursor: Any, st: Any, job: NewJob, push_id: int) -> tuple:
    """The upsert of `job` that returns the row it leaves; on PostgreSQL a job due now
    also wakes its queue's listeners, in the same statement (see `announce`)."""
    params = job.params(cursor.db, push_id)
    wake = bool(db.dialect(cursor.db).notify) and job.due_now
    returning = st.returning_pushed_notify if wake else st.returning_pushed
    values = st.values_at if job.run_at is not None else st.values_after
    cursor.execute(st.insert + values + st.merge_waiting + returning, (params + [CHANNEL]) if wake else params)
    (row,) = cursor.fetchall()  # read to its end: SQLite commits then
    return row[:-1] if wake else row


def _pushed_row(cursor: Any, job: NewJob, push_id: int) -> tuple | None:
    """The row of `job`'s key that `push_id` wrote or merged into, as it is now; None if none."""
    cursor.execute(sql.jobs(cursor.db).pushed_by, (job.key, push_id, push_id))
    return cursor.fetchone()


def reschedule(job: NewJob, using: str, push_id: int) -> tuple | None:
    """Move the waiting job with this key to the new run time, counting the push (a full
    queue's dedupe, which adds no waiting job); its row, or None if none waits. Two
    statements where an UPDATE returns no row: a claim in between leaves the row found by
    the push's id, as does a retry after a lost reply."""

    def work(cursor: Any, resumed: bool) -> tuple | None:
        if resumed and (row := _pushed_row(cursor, job, push_id)):
            return row
        st = sql.jobs(cursor.db)
        if job.run_at is not None:
            when, statement = db.dialect(cursor.db).stored_datetime(job.run_at), st.move_waiting_at
        else:
            when, statement = db.dialect(cursor.db).seconds(job.delay), st.move_waiting_after
        cursor.execute(statement, (when, job.priority, push_id, job.key))
        return _pushed_row(cursor, job, push_id) if cursor.rowcount > 0 else None

    return db.run(work, using)


#: The columns of a pushed job's row (sql "waiting_by_key", "pushed_by", "returning_pushed"), by attname.
_PUSHED = ("id", "queue", "name", "backend", "payload", "key", "pending_key", "priority", "run_at", "status",
           "attempt", "max_attempts", "enqueued_at", "pushes")


@cache
def _job_layout() -> tuple[list, dict[str, int]]:
    """A Job's field defaults in field order, and each field's place by attname. A Job
    made from all its fields in order skips the per-field work of keyword construction,
    which cost a push as much as `new_job`. The defaults of the fields not read back are
    text, numbers or None, so Jobs share them safely (tests/tasks/test_push_fast.py)."""
    fields = Job._meta.concrete_fields
    return [field.get_default() for field in fields], {field.attname: index for index, field in enumerate(fields)}


def _as_job(pushed: NewJob, row: tuple, using: str) -> Job:
    """The Job as the database holds it after the push, which may be an older waiting job
    of the same key: then `merged` is true, and a warning says if its work differs. After
    a lost reply it is the job as it is by then (a worker may have started it). Fields
    not read back hold their defaults."""
    stored = dict(zip(_PUSHED, row))
    name, key, pk = stored["name"], stored["key"], stored["id"]
    stored.update(payload=load_json(stored["payload"]), run_at=db.to_datetime(stored["run_at"]),
                  enqueued_at=db.to_datetime(stored["enqueued_at"]))
    defaults, places = _job_layout()
    values = defaults.copy()
    for attname, value in stored.items():
        values[places[attname]] = value
    obj = Job.from_db(using, None, values)
    obj.merged = stored["pushes"] > 1
    if obj.merged and (name, obj.backend, obj.payload) != (pushed.name, pushed.backend, load_json(pushed.payload)):
        log.warning(
            "push of %s with key %r merged into waiting job %s #%d, which keeps its own name and payload",
            pushed.name, key, name, pk,
        )
    return obj


def submit(job: NewJob, using: str | None = None) -> Job | None:
    """Write one job under its queue's bound: the Job as stored (a new one, or the waiting
    one its key merged into), or None if the job was buffered. It goes to `using`, else
    to the database its queue is routed to."""
    using = routing.route("queues", job.queue, using)
    queue = queues.queue_settings(job.queue, using)
    push_id = new_push_id()
    if not queues.has_room(queue, 1, using):
        if moved := reschedule(job, using, push_id):
            return _as_job(job, moved, using)
        if not queues.make_room(queue, 1, using):
            _buffer.add(queue, [job], using, 1, push_id)
            return None
    return _as_job(job, insert_one(job, using, push_id), using)


def _batches(jobs: Sequence[NewJob]) -> Iterable[Sequence[NewJob]]:
    """Runs of at most BATCH jobs and BATCH_CHARS of payload: one statement each."""
    start, size = 0, 0
    for index, job in enumerate(jobs):
        size += len(job.payload)
        if index - start == BATCH or (size > BATCH_CHARS and index > start):
            yield jobs[start:index]
            start, size = index, len(job.payload)
    if start < len(jobs):
        yield jobs[start:]


def submit_many(jobs: Sequence[NewJob], using: str | None = None) -> int:
    """Write jobs, a batch per statement; each queue's bound is checked per batch.

    Every queue is looked up before the first batch, so an unknown one writes nothing.
    Jobs go to `using`, else each to the database its queue is routed to.
    """
    groups: dict[str, list[NewJob]] = {}
    for job in jobs:
        groups.setdefault(routing.route("queues", job.queue, using), []).append(job)
    for alias, group in groups.items():
        for name in sorted({job.queue for job in group}):
            queues.queue_settings(name, alias)
    return sum(_submit_batches(group, alias) for alias, group in groups.items())


def _submit_batches(jobs: Sequence[NewJob], using: str) -> int:
    written = 0
    for batch in _batches(jobs):
        by_queue: dict[str, int] = {}
        for job in batch:
            by_queue[job.queue] = by_queue.get(job.queue, 0) + 1
        buffered = False
        for name, count in by_queue.items():
            queue = queues.queue_settings(name, using)
            if not queues.has_room(queue, count, using) and not queues.make_room(queue, count, using):
                _buffer.add(queue, batch, using, count, new_push_id())
                buffered = True
        if buffered:
            continue
        insert(batch, using)
        written += len(batch)
    return written


# -- the buffer of jobs a full queue refused ----------------------------------------------

_buffer = Buffer(insert)


def buffered() -> int:
    """Jobs this process holds because their queue was full."""
    return len(_buffer)


def flush_buffer(timeout: float = 30.0) -> bool:
    """Wait until every buffered job is pushed or dropped; False if some remain."""
    return _buffer.wait_empty(timeout)


# -- the public API ---------------------------------------------------------------------


def push(
    name: str,
    payload: Any = None,
    *,
    delay: float | timedelta = 0,
    run_at: datetime | None = None,
    queue: str | None = None,
    priority: int = 0,
    key: str | None = None,
    max_attempts: int | None = None,
    limit_key: str | None = None,
    concurrency: int | None = None,
    rate: str | None = None,
    using: str | None = None,
) -> Job | None:
    """Queue a job for the handler `name`, to run `delay` seconds from now (server clock).

    Returns the waiting Job as the database holds it: a new one, or the one already
    waiting with the same key, moved to the new run time and priority (`job.merged` is
    then true; if that job has another name or payload, it keeps them and a warning is
    logged). When the queue is full its `when_full` policy applies: QueueFull, a wait,
    or (buffer) None while the job waits in this process. `limit_key`, `concurrency`
    and `rate` override the handler's (see leases.tasks.jobs.limits).
    """
    job = new_job(
        name, payload, delay=delay, run_at=run_at, queue=queue, priority=priority, key=key,
        max_attempts=max_attempts, limit_key=limit_key, concurrency=concurrency, rate=rate,
    )
    return submit(job, using)


def push_many(
    items: Iterable[tuple[str, Any] | tuple[str, Any, dict]],
    using: str | None = None,
) -> int:
    """Queue many jobs, one INSERT per BATCH: items are (name, payload) or (name, payload,
    options) with push()'s keyword options. Every item is validated before any is written.
    Returns the number of jobs written (new or rescheduled); buffered ones are not counted.
    """
    jobs = []
    for index, item in enumerate(items):
        try:
            name, payload, *rest = item
            options = rest[0] if rest else {}
            jobs.append(new_job(name, payload, **options))
        except (TypeError, ValueError, LookupError) as exc:
            raise type(exc)(f"item {index}: {exc}") from None
    return submit_many(jobs, using)
