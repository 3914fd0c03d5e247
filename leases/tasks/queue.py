"""The delayed job queue: push jobs, bound queues, prune history, and operators' actions.

A push is one upsert: a job whose key (default: a hash of name and payload) is already
waiting is not queued twice; it only takes the new run time (the seed's reschedule). The
run time is the server clock plus the delay, computed in the statement. A push inside a
transaction is seen by workers when it commits. Workers live in `leases.tasks.worker`.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Sequence

from django.conf import settings
from django.db import connections

from leases import db, routing
from leases.exceptions import QueueFull
from leases.sql import in_list, statements
from leases.validation import check_moment, check_seconds, dump_json

from . import limits, registry
from .models import KEY_LENGTH, PRIORITY_RANGE, Job, Queue
from .registry import check_queue

log = logging.getLogger("leases.tasks")

#: Jobs per INSERT statement in push_many ...
BATCH = 1000
#: ... and at most this many characters of payload per statement (at most 4 bytes each),
#: well under MySQL's default max_allowed_packet of 16 MiB.
BATCH_CHARS = 2 << 20
#: Seconds a process trusts its copy of a queue's settings.
SETTINGS_TTL = 1.0
#: Finished runs kept per key unless settings.LEASES_KEEP_RUNS says otherwise.
KEEP_RUNS = 100
#: Attempts of an on_finish job whose handler this process does not know.
FOLLOW_UP_ATTEMPTS = 100


# -- validation -------------------------------------------------------------------------


def check_priority(priority: Any) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise ValueError(f"priority must be a whole number from {low} to {high}, not {priority!r}")
    return priority


def dump_payload(payload: Any, what: str = "payload") -> str:
    """JSON text the database stores as it is (never pickle): ValueError for what JSON
    cannot carry, lone surrogates, nesting past 31 levels and LEASES_MAX_JSON_BYTES."""
    return dump_json(payload, what, sort_keys=True)


def default_key(name: str, payload_json: str) -> str:
    """The seed's message hash: equal name and payload, equal key."""
    return hashlib.sha256(f"{name}\n{payload_json}".encode()).hexdigest()


def check_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > KEY_LENGTH:
        raise ValueError(f"key must be a non-empty string of at most {KEY_LENGTH} characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"key holds a lone surrogate (text that is not valid Unicode): {key!r}") from None
    return key


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
    backend: str = ""
    #: Handler of the job queued when this one ends for good (see Job.on_finish).
    on_finish: str = ""
    #: The key its limits count by, and those limits (see leases.tasks.limits).
    limit_key: str = ""
    concurrency: int | None = None
    rate: str = ""

    def params(self, connection: Any) -> list:
        head = [self.queue, self.name, self.backend, self.on_finish, self.payload, self.key, self.key, self.priority]
        head += [self.limit_key, self.concurrency, self.rate, self.max_attempts]
        if self.run_at is not None:
            return head + [db.dialect(connection).stored_datetime(self.run_at)]
        return head + [db.dialect(connection).seconds(self.delay)]


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
) -> NewJob:
    """Validate one push, raising ValueError/UnknownHandler before anything is written.
    `limit_key`, `concurrency` and `rate` override the handler's (see leases.tasks.limits)."""
    spec = registry.get(name)
    text = dump_payload(payload)
    key_of = limit_key if limit_key is not None else spec.limit_key
    delay = check_seconds(delay, "delay")
    if run_at is not None:
        if delay:
            raise ValueError("give delay or run_at, not both")
        run_at = check_moment(run_at, "run_at")
    return NewJob(
        queue=spec.queue if queue is None else check_queue(queue),  # a handler's was checked
        name=name,
        payload=text,
        key=default_key(name, text) if key is None else check_key(key),
        priority=check_priority(priority),
        max_attempts=spec.max_attempts if max_attempts is None else registry.check_attempts(max_attempts),
        delay=delay,
        run_at=run_at,
        limit_key=limits.key_of(key_of, payload),
        concurrency=spec.concurrency if concurrency is None else limits.check_concurrency(concurrency),
        rate=spec.rate if rate is None else limits.check_rate(rate),
    )


# -- queue settings ---------------------------------------------------------------------


@dataclass(frozen=True)
class QueueSettings:
    name: str
    paused: bool = False
    max_length: int | None = None
    when_full: str = Queue.REJECT
    full_timeout: float = 30.0


_settings: dict[tuple[str, str], tuple[float, QueueSettings]] = {}
_settings_lock = threading.Lock()


def known_queues(using: str | None = None) -> set[str]:
    """Queues jobs may go to: those with a row, a handler's, or a Tasks backend's."""
    names = set(all_queues(using)) | {spec.queue for spec in registry.registered().values()}
    try:
        from .backend import configured_queues
    except ImportError:  # no Tasks framework installed: native jobs only
        return names
    return names | configured_queues()


def queue_settings(name: str, using: str | None = None, create: bool = True) -> QueueSettings:
    """A queue's settings as of at most SETTINGS_TTL ago; the row is made on first use.

    With `create`, a queue nobody declared (no row, no handler or Tasks backend names it)
    is a ValueError: a misspelt queue would otherwise hold jobs no worker serves.
    """
    using = db.alias(using)
    now = time.monotonic()
    with _settings_lock:
        cached = _settings.get((using, name))
    if cached and cached[0] > now:
        return cached[1]
    row = db.run(_queue_row(name), using)
    if row is None and create:
        known = known_queues(using)
        if name not in known:
            raise ValueError(
                f"unknown queue {name!r} (known: {', '.join(sorted(known)) or 'none'}); name it in a"
                " handler or TASKS, or add it as a Queue row"
            )
        if not connections[using].in_atomic_block:
            db.run(_add_queue(name), using)
    found = QueueSettings(name, *row) if row else QueueSettings(name)
    with _settings_lock:
        _settings[(using, name)] = (now + SETTINGS_TTL, found)
    return found


def _queue_row(name: str) -> Callable[[Any, bool], tuple | None]:
    def work(cursor: Any, resumed: bool) -> tuple | None:
        cursor.execute(statements(cursor.db, "job").queue, (name,))
        return cursor.fetchone()

    return work


def _add_queue(name: str) -> Callable[[Any, bool], None]:
    defaults = QueueSettings(name)

    def work(cursor: Any, resumed: bool) -> None:
        cursor.execute(
            statements(cursor.db, "job").add_queue,
            (name, defaults.paused, defaults.when_full, defaults.full_timeout),
        )

    return work


def all_queues(using: str | None = None) -> dict[str, QueueSettings]:
    """Every queue with a row (all queues ever pushed to), by name."""
    rows = Queue.objects.using(db.alias(using)).values_list("name", "paused", "max_length", "when_full", "full_timeout")
    return {row[0]: QueueSettings(*row) for row in rows}


def forget_settings() -> None:
    """Drop the cached queue settings (after an operator changed them in this process)."""
    with _settings_lock:
        _settings.clear()


def has_room(queue: QueueSettings, count: int, using: str | None = None) -> bool:
    """Whether `count` more waiting jobs fit under the queue's max_length.

    Reads at most max_length index entries. Racing pushers may overshoot the bound by
    the jobs they push at the same moment: the bound is a brake, not a constraint.
    """
    if queue.max_length is None:
        return True
    offset = queue.max_length - count
    if offset < 0:
        return False

    def work(cursor: Any, resumed: bool) -> bool:
        cursor.execute(statements(cursor.db, "job").full, (queue.name, offset))
        return cursor.fetchone() is None

    return db.run(work, using)


# -- writing jobs -----------------------------------------------------------------------


def insert(jobs: Sequence[NewJob], using: str | None = None, fetch_key: str | None = None) -> tuple | None:
    """Write `jobs` with one upsert; with `fetch_key`, return that job's row in the same
    transaction (so no worker can claim it in between and hide it).

    If the connection died under an earlier try, the push may have committed: a job
    waiting under `fetch_key` is then taken as it is rather than pushed a second time.
    """

    def work(cursor: Any, resumed: bool) -> tuple | None:
        st = statements(cursor.db, "job")
        with db.write_transaction(cursor.db.alias):
            if resumed and fetch_key is not None:
                cursor.execute(st.pushed, (fetch_key,))
                if row := cursor.fetchone():
                    return row
            write(cursor, jobs)
            if fetch_key is None:
                return None
            cursor.execute(st.pushed, (fetch_key,))
            return cursor.fetchone()

    return db.run(work, using)


def write(cursor: Any, jobs: Sequence[NewJob]) -> None:
    """Write `jobs` with one upsert on the caller's cursor, in its transaction."""
    st = statements(cursor.db, "job")
    params: list = []
    rows = []
    for job in jobs:
        rows.append(st.row_at if job.run_at is not None else st.row)
        params += job.params(cursor.db)
    cursor.execute(st.insert + ", ".join(rows) + st.insert_tail, params)


def follow_up(job_id: int, queue: str, on_finish: str) -> NewJob:
    """The job queued when job `job_id` ends for good: on its queue (which a worker
    serves), ahead of ordinary work, once per ending (its key merges a second one)."""
    spec = registry.find(on_finish)
    return NewJob(
        queue=queue, name=on_finish, payload=json.dumps({"job": job_id}), key=f"{on_finish}:{job_id}",
        priority=PRIORITY_RANGE[1], max_attempts=spec.max_attempts if spec else FOLLOW_UP_ATTEMPTS,
    )


def follow_ups(cursor: Any, ended: Iterable[tuple[int, str, str]]) -> None:
    """Queue the on_finish job of each (id, queue, on_finish) that just ended for good,
    in the caller's transaction, so the ending and its notice commit together; endings
    whose on_finish has a finisher (registry.add_finisher) go to it, a batch at a time."""
    batches: dict[str, list[tuple[int, str]]] = {}
    for job_id, queue, on_finish in ended:
        if not on_finish:
            continue
        if registry.finisher(on_finish) is not None:
            batches.setdefault(on_finish, []).append((job_id, queue))
        else:
            write(cursor, [follow_up(job_id, queue, on_finish)])
    for on_finish, batch in batches.items():
        registry.finisher(on_finish)(cursor, batch)


def reschedule(job: NewJob, using: str | None = None) -> bool:
    """Move the waiting job with this key to the new run time; False if none waits."""

    def work(cursor: Any, resumed: bool) -> bool:
        st = statements(cursor.db, "job")
        if job.run_at is not None:
            when, sql = db.dialect(cursor.db).stored_datetime(job.run_at), st.reschedule_at
        else:
            when, sql = db.dialect(cursor.db).seconds(job.delay), st.reschedule
        cursor.execute(sql, (when, job.priority, job.key))
        return cursor.rowcount > 0

    return db.run(work, using)


def _as_job(pushed: NewJob, row: tuple, using: str) -> Job:
    """The Job as the database holds it after the push, which may be an older waiting job
    of the same key: then `merged` is true, and a warning says if its work differs."""
    pk, queue, name, backend, payload, key, priority, run_at, status, attempt, max_attempts, enqueued_at, pushes = row
    obj = Job(
        pk=pk,
        queue=queue,
        name=name,
        backend=backend,
        payload=json.loads(payload) if isinstance(payload, (str, bytes)) else payload,
        key=key,
        pending_key=key,
        priority=priority,
        run_at=db.to_datetime(run_at),
        status=status,
        attempt=attempt,
        max_attempts=max_attempts,
        enqueued_at=db.to_datetime(enqueued_at),
        pushes=pushes,
    )
    obj._state.adding = False
    obj._state.db = using
    obj.merged = pushes > 1
    if obj.merged and (name, backend, obj.payload) != (pushed.name, pushed.backend, json.loads(pushed.payload)):
        log.warning(
            "push of %s with key %r merged into waiting job %s #%d, which keeps its own name and payload",
            pushed.name, key, name, pk,
        )
    return obj


def submit(job: NewJob, using: str | None = None) -> Job | None:
    """Write one validated job under its queue's bound: the Job as stored (a new one, or
    the waiting one its key merged into), or None if the job was buffered. It goes to
    `using`, else to the database its queue is routed to."""
    using = routing.route("queues", job.queue, using)
    queue = queue_settings(job.queue, using)
    if not has_room(queue, 1, using) and not reschedule(job, using):
        if not _when_full(queue, [job], using):
            return None
    row = insert([job], using, fetch_key=job.key)
    return _as_job(job, row, using)


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
    """Write validated jobs, a batch per statement; each queue's bound is checked per batch.

    Every queue is looked up before the first batch, so an unknown one writes nothing.
    Jobs go to `using`, else each to the database its queue is routed to.
    """
    groups: dict[str, list[NewJob]] = {}
    for job in jobs:
        groups.setdefault(routing.route("queues", job.queue, using), []).append(job)
    for alias, group in groups.items():
        for name in sorted({job.queue for job in group}):
            queue_settings(name, alias)
    return sum(_submit_batches(group, alias) for alias, group in groups.items())


def _submit_batches(jobs: Sequence[NewJob], using: str) -> int:
    written = 0
    for batch in _batches(jobs):
        by_queue: dict[str, int] = {}
        for job in batch:
            by_queue[job.queue] = by_queue.get(job.queue, 0) + 1
        buffered = False
        for name, count in by_queue.items():
            queue = queue_settings(name, using)
            if not has_room(queue, count, using):
                buffered |= not _when_full(queue, batch, using, count)
        if buffered:
            continue
        insert(batch, using)
        written += len(batch)
    return written


def _when_full(queue: QueueSettings, jobs: Sequence[NewJob], using: str, count: int = 1) -> bool:
    """Apply the queue's policy: True when there is room now, False when buffered."""
    if queue.when_full == Queue.WAIT:
        deadline = time.monotonic() + queue.full_timeout
        pause = 0.05
        while time.monotonic() < deadline:
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            if has_room(queue, count, using):
                return True
            pause = min(pause * 2, 1.0)
    elif queue.when_full == Queue.BUFFER:
        _buffer.add(queue, jobs, using, count)
        return False
    raise QueueFull(f"queue {queue.name!r} holds its max_length of {queue.max_length} waiting jobs")


class _Buffer:
    """The seed's buffer queue: jobs a full queue refused, kept in this process.

    A daemon thread retries them as room appears and drops (with an error in the log)
    what is still here after the queue's full_timeout. They live in memory only: a job
    buffered when the process exits is lost, which `atexit` reports.
    """

    def __init__(self) -> None:
        self._items: deque[tuple[float, QueueSettings, Sequence[NewJob], str, int]] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def add(self, queue: QueueSettings, jobs: Sequence[NewJob], using: str, count: int) -> None:
        with self._lock:
            self._items.append((time.monotonic() + queue.full_timeout, queue, list(jobs), using, count))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="leases-push-buffer", daemon=True)
                self._thread.start()
            self._lock.notify_all()
        log.warning("queue %s is full: %d job(s) buffered in this process", queue.name, len(jobs))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(item[2]) for item in self._items)

    def wait_empty(self, timeout: float) -> bool:
        """Block until the buffer is empty (written or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._items:
                        return
                    item = self._items[0]
                if not self._try(item):
                    time.sleep(0.2)
        finally:
            connections.close_all()

    def _try(self, item: tuple) -> bool:
        deadline, queue, jobs, using, count = item
        try:
            room = has_room(queue_settings(queue.name, using), count, using)
            if room:
                insert(jobs, using)
        except Exception:
            log.exception("buffered push to queue %s failed; will retry", queue.name)
            room = False
        if not room and time.monotonic() < deadline:
            return False
        if not room:
            self.dropped += len(jobs)
            log.error(
                "dropped %d buffered job(s) of queue %s: still full after %.0fs (first: %s)",
                len(jobs), queue.name, queue.full_timeout, jobs[0].name,
            )
        with self._lock:
            self._items.popleft()
            self._lock.notify_all()
        return True


_buffer = _Buffer()


@atexit.register
def _report_buffer() -> None:
    left = len(_buffer)
    if left:
        log.error("exiting with %d buffered job(s) not pushed", left)


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
    or (buffer) None while the job waits in this process.
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


# -- history ----------------------------------------------------------------------------


def keep_runs() -> int:
    value = getattr(settings, "LEASES_KEEP_RUNS", KEEP_RUNS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LEASES_KEEP_RUNS must be a whole number >= 1, not {value!r}")
    return value


def _delete(ids: list, using: str | None) -> int:
    if not ids:
        return 0

    def work(cursor: Any, resumed: bool) -> int:
        st = statements(cursor.db, "job")
        with db.write_transaction(cursor.db.alias):
            cursor.execute(st.delete_errors + in_list(ids), ids)
            cursor.execute(st.delete + in_list(ids), ids)
            return cursor.rowcount

    return db.run(work, using)


def _select_ids(key: str, params: tuple, using: str | None) -> list:
    def work(cursor: Any, resumed: bool) -> list:
        cursor.execute(getattr(statements(cursor.db, "job"), key), params)
        return [row[0] for row in cursor.fetchall()]

    return db.run(work, using)


def trim_runs(keys: Iterable[str], keep: int | None = None, using: str | None = None) -> int:
    """Delete finished runs of each key beyond the newest `keep` (LEASES_KEEP_RUNS)."""
    keep = keep_runs() if keep is None else keep
    keys = sorted(set(keys))
    deleted = 0
    for start in range(0, len(keys), 500):
        for key in _crowded(keys[start : start + 500], keep, using):
            while ids := _select_ids("old_runs", (key, keep), using):
                deleted += _delete(ids, using)
    return deleted


def _crowded(keys: list[str], keep: int, using: str | None) -> list[str]:
    """The keys with more than `keep` finished runs: one index lookup per key, one query."""

    def work(cursor: Any, resumed: bool) -> list[str]:
        st = statements(cursor.db, "job")
        cursor.execute(st.crowded + in_list(keys) + st.crowded_tail, (*keys, keep))
        return [row[0] for row in cursor.fetchall()]

    return db.run(work, using)


def prune(
    older_than: float,
    batch_size: int = 1000,
    using: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete jobs finished more than `older_than` seconds ago, in batches; returns the count.

    The cutoff is taken from the server clock once, so the batches agree on it.
    """
    from leases.pool import db_now

    cutoff = db.dialect(connections[db.alias(using)]).stored_datetime(
        db_now(using) - timedelta(seconds=older_than)
    )
    deleted = 0
    while ids := _select_ids("expired", (cutoff, batch_size), using):
        count = _delete(ids, using)
        deleted += count
        if progress:
            progress(count)
    return deleted


# -- operators' actions -----------------------------------------------------------------


def _update_ids(key: str, ids: Sequence[int], using: str | None) -> int:
    changed = 0
    for chunk in _chunks(list(ids)):

        def work(cursor: Any, resumed: bool) -> int:
            cursor.execute(getattr(statements(cursor.db, "job"), key) + in_list(chunk), chunk)
            return cursor.rowcount

        changed += db.run(work, using)
    return changed


def _chunks(ids: list, size: int = 500) -> Iterable[list]:
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def cancel(ids: Sequence[int], using: str | None = None) -> int:
    """Cancel waiting jobs (running ones are left to finish); returns how many."""
    cancelled = 0
    for chunk in _chunks(list(ids)):

        def work(cursor: Any, resumed: bool) -> int:
            st = statements(cursor.db, "job")
            with db.write_transaction(cursor.db.alias):
                cursor.execute(st.cancellable + in_list(chunk) + db.for_update(cursor.db), chunk)
                rows = cursor.fetchall()
                if not rows:
                    return 0
                doomed = [row[0] for row in rows]
                cursor.execute(st.cancel + in_list(doomed), doomed)
                count = cursor.rowcount
                follow_ups(cursor, rows)
                return count

        cancelled += db.run(work, using)
    return cancelled


def retry(ids: Sequence[int], using: str | None = None) -> int:
    """Give failed, dead or cancelled jobs one more attempt, now; returns how many."""
    return _update_ids("again", ids, using)


def discard(ids: Sequence[int], using: str | None = None) -> int:
    """Delete jobs that are not running, with their errors; returns how many. A waiting
    job's on_finish job is queued (its handler finds the job gone).

    The deletable rows are locked first, so a job a worker claims meanwhile keeps its
    error history along with its row.
    """
    deleted = 0
    for chunk in _chunks(list(ids)):

        def work(cursor: Any, resumed: bool) -> int:
            st = statements(cursor.db, "job")
            with db.write_transaction(cursor.db.alias):
                cursor.execute(st.discardable + in_list(chunk) + db.for_update(cursor.db), chunk)
                rows = cursor.fetchall()
                doomed = [row[0] for row in rows]
                if not doomed:
                    return 0
                cursor.execute(st.delete_errors + in_list(doomed), doomed)
                cursor.execute(st.discard + in_list(doomed), doomed)
                count = cursor.rowcount
                follow_ups(cursor, [(job_id, queue, then) for job_id, status, queue, then in rows if status in Job.WAITING])
                return count

        deleted += db.run(work, using)
    return deleted


def select_batches(
    status: int | str,
    queue: str | None = None,
    before: datetime | None = None,
    size: int = 500,
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
