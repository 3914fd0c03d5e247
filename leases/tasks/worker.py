"""The pull-on-demand worker behind `manage.py leases_worker`.

One main thread talks to the database; `concurrency` threads run handlers. The main
thread claims only as many jobs as there are free threads (the seed's control tokens),
in one short transaction (`FOR UPDATE SKIP LOCKED`, or SQLite's immediate transaction),
and writes the outcomes of finished jobs in one transaction per loop.

Crash safety: the worker's process row is a lease renewed by its heartbeat, and each
job it runs carries a lease (`expires_at`) the same heartbeat extends, job by job. When a
worker stops heartbeating, any live worker puts its jobs back to ready (or dead, when no
attempt is left). Every outcome names the claim it ends, so a late finisher writes
nothing. A claim whose reply was lost is found again by the worker's name before it
claims more. An outcome the database refuses fails its job with that error instead of
blocking the others, and no exception of a handler, however odd, reaches the loop.
"""
from __future__ import annotations

import json
import logging
import os
import queue as stdqueue
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import Error, connections

from leases import db, routing
from leases.exceptions import BadResult, Fail, LeaseLost, UnknownHandler, WorkerLost
from leases.lease import Hold, make_holder
from leases.management.text import span
from leases.sql import in_list, statements
from leases.validation import check_seconds, clean_text

from . import limits, registry
from . import queue as jobqueue
from .models import Job
from .scheduler import Scheduler

log = logging.getLogger("leases.tasks.worker")

T = TypeVar("T")

#: Seconds between recoveries of lapsed jobs (the ttl bounds how stale they can be).
RECOVER_EVERY = 5.0
#: Seconds between trims of keys' old runs.
TRIM_EVERY = 10.0
#: Lapsed jobs recovered per statement batch.
RECOVER_BATCH = 100
#: Worker rows gone this long are deleted.
FORGET_AFTER = 86400.0
#: Seconds before a job this worker has no handler for may be claimed again.
BOUNCE_DELAY = 10.0
#: Seconds a job may wait for a worker with its handler before it fails
#: (settings.LEASES_HANDLER_GRACE).
HANDLER_GRACE = 600.0
#: A --burst worker stays for retries of its own jobs due within this many seconds.
BURST_RETRY_WAIT = 60.0
#: Bounds of what one failed attempt stores, in characters (the class path's column
#: holds 255); the middle of a longer text is cut, the end of a traceback kept.
CLASS_PATH_LIMIT = 255
MESSAGE_LIMIT = 10_000
TRACEBACK_LIMIT = 50_000
#: Seconds between two log lines naming the keys held at their limit.
LIMIT_LOG_EVERY = 30.0
#: Seconds a handler thread's connection may sit idle before it is pinged before a job.
IDLE_CHECK = 30.0
#: Shortest worker ttl: the heartbeat runs between claims and outcome writes, and one
#: slow commit must not let a running job's lease lapse.
MIN_TTL = 1.0


def describe(exc: BaseException) -> tuple[str, str, str]:
    """(class path, message, traceback) of `exc`, storable as they are: lone surrogates
    escaped, each cut to its limit. Never raises, whatever the exception's __str__ does."""
    cls = type(exc)
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ is the handler's bug, not ours
        message = f"<{cls.__name__}.__str__ failed>"
    trace = "".join(traceback.format_exception(exc))
    return (
        clean_text(f"{cls.__module__}.{cls.__qualname__}", CLASS_PATH_LIMIT),
        clean_text(message, MESSAGE_LIMIT),
        clean_text(trace, TRACEBACK_LIMIT),
    )


def _pairs(count: int) -> str:
    return " OR ".join(["(id = %s AND claims = %s)"] * count) + ")"


@dataclass
class ClaimedJob:
    """One attempt this worker runs: what the handler needs and what fences the outcome."""

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
    #: The key its limits count by, and the job's own limits (see leases.tasks.limits).
    limit_key: str = ""
    concurrency: int | None = None
    rate: str = ""
    #: What runs it (`handler_for`), found when it was claimed.
    handler: Any = None
    #: Set by the main thread when the attempt timed out: its outcome is already written.
    abandoned: bool = False
    deadline: float | None = None


@dataclass
class Outcome:
    job: ClaimedJob
    ok: bool
    result: str = "null"
    error: tuple[str, str, str] | None = None
    #: False for Fail, BadResult and a job no handler can run: no retry.
    retryable: bool = True
    #: Seconds before the next attempt (from the handler's backoff).
    delay: float = 0.0
    #: No handler here: back to the queue for a worker that has one (no try used).
    bounce: bool = False
    #: Seconds the attempt ran (for the log).
    seconds: float = 0.0

    def refused(self, exc: BaseException) -> Outcome:
        """What to write instead when the database refused this outcome: a failure whose
        error says so (a result refused fails for good, as a handler's rerun repeats work)."""
        error = describe(BadResult(f"the database refused this attempt's outcome: {describe(exc)[1][:1000]}"))
        if self.ok:
            return replace(self, ok=False, error=error, retryable=False, bounce=False)
        return replace(self, error=error, bounce=False)


def handler_for(job: ClaimedJob) -> Any:
    """The object that runs `job`: a registered handler, an app's runner for its backend
    (pipelines), or a Django Tasks task."""
    if job.backend:
        factory = registry.runner(job.backend)
        if factory is not None:
            return factory(job)
        from .backend import task_handler

        return task_handler(job)
    return registry.get(job.name)


def execute(job: ClaimedJob) -> Outcome:
    """Run one attempt; whatever the handler does or returns becomes its outcome."""
    _check_idle_connections()
    began = time.monotonic()
    try:
        outcome = _attempt(job)
        outcome.seconds = time.monotonic() - began
        return outcome
    finally:
        _tidy_connections()


def _attempt(job: ClaimedJob) -> Outcome:
    try:
        spec = job.handler or handler_for(job)
    except Exception as exc:  # noqa: BLE001 - e.g. a task path that is not a task
        return _failed(job, exc, retryable=False)
    try:
        value = spec.run(job)
    except (Fail, BadResult) as exc:
        return _failed(job, exc, retryable=False)
    except BaseException as exc:  # noqa: BLE001 - a handler must never kill the worker
        return _failed(job, exc, retryable=True, delay=spec.delay(job.attempt))
    try:
        return Outcome(job, ok=True, result=jobqueue.dump_payload(value, "the handler's return value"))
    except ValueError as exc:
        return _failed(job, BadResult(str(exc)), retryable=False)


def _tidy_connections() -> None:
    """After a job: keep the handler thread's connections for the next one, as a
    long-lived process should, but close any that is broken, was left with autocommit
    changed, or is older than CONN_MAX_AGE when that is set. Django's per-request rule
    (CONN_MAX_AGE = 0 closes after every request) would open a connection per job, which
    costs more than a small job itself (3 to 11 ms on MariaDB). Failures are no news."""
    for connection in connections.all(initialized_only=True):
        try:
            if connection.settings_dict["CONN_MAX_AGE"] == 0:
                connection.close_at = None  # lives across jobs, like a persistent connection
            connection.close_if_unusable_or_obsolete()
            connection.leases_used_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a dead connection is reopened on next use
            log.debug("tidying a connection failed: %s", db.one_line(exc))


def _check_idle_connections() -> None:
    """Before a job: a connection idle for IDLE_CHECK seconds may have been dropped by
    the server (wait_timeout, a restart); ping it and close it if so, so the handler's
    first query opens a new one rather than failing."""
    for connection in connections.all(initialized_only=True):
        try:
            idle = time.monotonic() - getattr(connection, "leases_used_at", 0.0)
            if connection.connection is not None and idle > IDLE_CHECK and not connection.is_usable():
                connection.close()
        except Exception as exc:  # noqa: BLE001 - a dead connection is reopened on next use
            log.debug("checking an idle connection failed: %s", db.one_line(exc))


def _failed(job: ClaimedJob, exc: BaseException, retryable: bool, delay: float = 0.0) -> Outcome:
    return Outcome(job, ok=False, error=describe(exc), retryable=retryable, delay=delay)


def _limits_of(job: ClaimedJob) -> tuple[str, int | None, str]:
    return job.limit_key, job.concurrency, job.rate


def _limits_of_row(row: tuple) -> tuple[str, int | None, str]:
    """(limit key, concurrency, rate) of a row of the claim's "pick"."""
    return row[12], row[13], row[14]


def handler_grace() -> float:
    value = getattr(settings, "LEASES_HANDLER_GRACE", HANDLER_GRACE)
    return check_seconds(value, "LEASES_HANDLER_GRACE")


class WorkerHold(Hold):
    """The worker's process row, held as a lease and renewed by its heartbeat."""

    kind = "worker"

    def __str__(self) -> str:
        return f"worker {self.holder}"


class _Threads:
    """`size` threads running handlers; a timed-out job's thread is replaced, and exits
    when its handler finally returns."""

    def __init__(self, size: int, done: stdqueue.Queue) -> None:
        self.work: stdqueue.SimpleQueue = stdqueue.SimpleQueue()
        self.done = done
        for _ in range(size):
            self.add()

    def add(self) -> None:
        threading.Thread(target=self._loop, name="leases-job", daemon=True).start()

    def _loop(self) -> None:
        try:
            while (job := self.work.get()) is not None:
                self.done.put(execute(job))
                if job.abandoned:
                    return  # a replacement took this thread's place
        finally:
            connections.close_all()

    def submit(self, job: ClaimedJob) -> None:
        self.work.put(job)


@dataclass
class Stats:
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    recovered: int = 0
    bounced: int = 0
    claims: int = 0
    started: float = field(default_factory=time.monotonic)


class Worker:
    """A worker process: `run()` until stopped, out of work (`burst`) or `max_jobs` done.

    `queues` is a list of names or ["*"] for all. `stop()` (SIGTERM) stops claiming and
    lets running jobs finish for up to `grace` seconds, then hands the rest back to ready.
    A worker serves one database: `using`, else the one its queues are routed to (`*`:
    LEASES_DATABASE); `manage.py leases_worker` runs one per database its queues need.
    """

    def __init__(
        self,
        queues: Iterable[str] = ("default",),
        concurrency: int = 4,
        poll: float = 0.05,
        ttl: float = 30.0,
        burst: bool = False,
        max_jobs: int | None = None,
        grace: float = 25.0,
        using: str | None = None,
        schedule: bool = False,
    ) -> None:
        self.queues = list(queues)
        self.all_queues = self.queues == ["*"]
        self.concurrency = concurrency
        self.poll = poll
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.using = database_of(self.queues, using)
        self.handler_grace = handler_grace()
        self.stats = Stats()
        self.running: dict[int, ClaimedJob] = {}
        self.hold: WorkerHold | None = None
        # A Queue, not a SimpleQueue: on CPython 3.11 a signal (SIGTERM) that lands near
        # the end of SimpleQueue.get(timeout=...) leaves it waiting forever.
        self._done: stdqueue.Queue = stdqueue.Queue()
        self._stop_at: float | None = None
        self._stop_requests = 0
        self._active: tuple[float, list[str]] = (0.0, [])
        self._finished_keys: set[str] = set()
        #: Outcomes not written yet (the database failed): their jobs stay ours.
        self._pending: list[Outcome] = []
        #: A claim failed after it may have committed: look up what we hold first.
        self._claim_unsure = False
        #: When a --burst worker may leave: its own retries due soon have run by then.
        self._retries_until = 0.0
        self._next_limit_log = 0.0
        #: Takes part in leading the scheduler (leases_worker does unless --no-schedule).
        self.schedule = schedule
        self.scheduler: Scheduler | None = None

    @property
    def name(self) -> str:
        return self.hold.holder if self.hold else ""

    # -- life cycle ---------------------------------------------------------------------

    def register(self) -> WorkerHold:
        """Insert this process's row and hold it as a lease."""
        holder = make_holder()
        sent_at = time.monotonic()

        def work(cursor: Any, resumed: bool) -> tuple:
            st = statements(cursor.db, "worker")
            if not resumed:
                cursor.execute(
                    st.register,
                    (holder, holder, ",".join(self.queues), self.concurrency, db.dialect(cursor.db).seconds(self.ttl)),
                )
            cursor.execute(st.registered, (holder,))
            return cursor.fetchone()

        worker_id, now = db.run(work, self.using)
        self.hold = WorkerHold(
            id=worker_id, token=1, holder=holder, ttl=self.ttl, sent_at=sent_at,
            db_anchor=db.to_datetime(now), mono_anchor=time.monotonic(), using=self.using,
        )
        log.info("worker %s started: queues %s, concurrency %d", holder, ",".join(self.queues), self.concurrency)
        return self.hold

    def when_up(self, call: Callable[[], T]) -> T | None:
        """`call()`, waiting out a database outage (saying so now and then); None if the
        worker was told to stop meanwhile. A worker started during an outage waits for the
        database rather than exiting, as one already running does."""
        started = said = time.monotonic()
        while True:
            try:
                return call()
            except Error as exc:
                if not db.transient(exc):
                    raise
                if self.stopping:
                    return None
                if time.monotonic() - said >= 30 or said == started:
                    said = time.monotonic()
                    log.warning("worker: database unavailable for %.0fs, waiting to start: %s", said - started, exc)
                time.sleep(2.0)

    def stop(self) -> None:
        """First call: finish gracefully. Second call: exit at once (jobs are recovered later)."""
        self._stop_requests += 1
        if self._stop_requests > 1:
            log.warning("worker %s: second stop request, exiting now", self.name)
            os._exit(1)
        self._stop_at = time.monotonic() + self.grace
        log.info("worker %s stopping: %d running, grace %.0fs", self.name, len(self.running), self.grace)

    @property
    def stopping(self) -> bool:
        return self._stop_at is not None

    def run(self) -> Stats:
        if self.hold is None and self.when_up(self.register) is None:
            return self.stats
        threads = _Threads(self.concurrency, self._done)
        if self.schedule:
            self.scheduler = Scheduler(self.name, self.ttl, self.using)
        next_beat = time.monotonic() + self.ttl / 3
        next_recover = 0.0
        next_trim = time.monotonic() + TRIM_EVERY
        try:
            while True:
                try:
                    now = time.monotonic()
                    if now >= next_beat:
                        self.heartbeat()
                        next_beat = now + self.ttl / 3
                    if now >= next_recover and not self.stopping:
                        self.recover()
                        next_recover = now + min(RECOVER_EVERY, self.ttl / 2)
                    if now >= next_trim:
                        self.trim()
                        next_trim = now + TRIM_EVERY
                    if self.scheduler is not None and not self.stopping:
                        self.scheduler.step()
                    claimed = self._claim_free(threads)
                    timed_out = self._expire_timeouts(threads)
                    outcomes = self._collect(wait=0)
                    self._flush(outcomes)
                    if self._should_exit(claimed + timed_out + len(outcomes)):
                        break
                    self._flush(self._collect(wait=self._wait_time()))
                except Error as exc:
                    # Outcomes not yet written stay pending, and the heartbeat keeps their
                    # jobs ours once it gets through. Beyond the ttl they are recovered.
                    log.error("worker %s: database error, retrying in 1s: %s", self.name, exc)
                    if self.stopping and time.monotonic() >= self._stop_at:
                        log.error("worker %s: grace over with the database failing; its jobs lapse"
                                  " and other workers recover them", self.name)
                        break
                    time.sleep(1.0)
            self._leave()
        finally:
            self._shutdown(threads)
        return self.stats

    def _leave(self) -> None:
        """On the way out: write what finished, hand back the rest, trim; best effort, as
        what is left lapses and is recovered by other workers."""
        try:
            self._flush([])
            if self.running or self._claim_unsure:
                self.hand_back()
            self.trim()
        except Error as exc:
            log.error("worker %s: could not hand back its jobs (%s); they are recovered when their"
                      " leases lapse", self.name, exc)

    def _should_exit(self, busy: int) -> bool:
        """`busy`: jobs claimed or finished in this round (burst mode goes on while any)."""
        if self.stopping:
            if not self.running:
                return True
            return time.monotonic() >= self._stop_at
        if self._max_reached() and not self.running:
            return True
        if not self.burst or busy or self.running or self._pending:
            return False
        return time.monotonic() >= self._retries_until

    def _wait_time(self) -> float:
        wait = self.poll
        if self.concurrency - len(self.running) <= 0 or self.stopping or self._max_reached():
            wait = max(self.poll, 0.5)  # nothing to claim: wake for outcomes, beats, deadlines
        deadlines = [job.deadline for job in self.running.values() if job.deadline is not None]
        if deadlines:
            wait = min(wait, max(0.0, min(deadlines) - time.monotonic()))
        if self._stop_at is not None:
            wait = min(wait, max(0.0, self._stop_at - time.monotonic()))
        return wait

    def _max_reached(self) -> bool:
        return self.max_jobs is not None and self.stats.claimed >= self.max_jobs

    def _shutdown(self, threads: _Threads) -> None:
        for _ in range(self.concurrency):
            threads.submit(None)  # type: ignore[arg-type]
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.hold is not None and not self.hold.lost:
            try:
                self.hold.release()
            except Exception:  # noqa: BLE001 - the row lapses on its own
                log.warning("worker %s: could not release its row", self.name, exc_info=True)
        log.info(
            "worker %s stopped: %d claimed, %d succeeded, %d failed, %d recovered, %d bounced",
            self.name, self.stats.claimed, self.stats.succeeded, self.stats.failed, self.stats.recovered,
            self.stats.bounced,
        )

    # -- claiming -----------------------------------------------------------------------

    def active_queues(self) -> list[str]:
        """The queues to claim from now: not paused; for "*", every known queue."""
        now = time.monotonic()
        if self._active[0] > now:
            return self._active[1]
        rows = jobqueue.all_queues(self.using)
        if self.all_queues:
            names = set(rows) | {spec.queue for spec in registry.registered().values()}
        else:
            names = set(self.queues)
        active = sorted(name for name in names if not (name in rows and rows[name].paused))
        self._active = (now + jobqueue.SETTINGS_TTL, active)
        return active

    def _claim_free(self, threads: _Threads) -> int:
        if self.stopping:
            return 0
        free = self.concurrency - len(self.running)
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        if free <= 0:
            return 0
        jobs = self.claim(free)
        now = time.monotonic()
        for job in jobs:
            try:
                job.handler = handler_for(job)
            except (UnknownHandler, ImportError, ImproperlyConfigured) as exc:
                # Not deployed here (yet): back to the queue for a worker that has it.
                self._pending.append(Outcome(job, ok=False, error=describe(exc), bounce=True))
                continue
            except Exception:  # noqa: BLE001 - execute() fails the attempt with this error
                pass
            self.running[job.id] = job
            timeout = getattr(job.handler, "timeout", None)
            job.deadline = now + timeout if timeout else None
            threads.submit(job)
        return len(jobs)

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs, highest priority first, then oldest run time.

        After a claim whose outcome is unknown (the connection died, maybe after COMMIT),
        first take back what is running under this worker's name and not known here.
        """
        active = self.active_queues()
        if not active and not self._claim_unsure:
            return []
        name = self.name
        known = set(self.running) | {outcome.job.id for outcome in self._pending}
        unsure = self._claim_unsure

        def work(cursor: Any, resumed: bool) -> list[ClaimedJob]:
            st = statements(cursor.db, "job")
            if resumed or unsure:
                cursor.execute(st.mine, (name,))
                found = [row for row in cursor.fetchall() if row[0] not in known]
                if found:
                    log.warning(
                        "worker %s: took back %d job(s) claimed before a lost reply: %s", name, len(found),
                        ", ".join(f"{row[4]} #{row[0]}" for row in found),
                    )
                    return [self._claimed(row, name, taken=True) for row in found]
            if not active:
                return []
            with db.write_transaction(self.using):
                rows: list[tuple] = []
                for queue in active:
                    cursor.execute(st.pick, (queue, limit))
                    rows += cursor.fetchall()
                if not rows:
                    return []
                if len(active) > 1:
                    rows.sort(key=lambda row: (-row[1], str(row[2]), row[0]))
                    rows = rows[:limit]
                rows, delayed = limits.within_limits(cursor, rows, _limits_of_row, self.using)
                if delayed is not None and delayed <= BURST_RETRY_WAIT:  # --burst waits for them
                    self._retries_until = max(self._retries_until, time.monotonic() + delayed + 1.0)
                if not rows:
                    return []
                ids = [row[0] for row in rows]
                cursor.execute(st.take + in_list(ids), (name, db.dialect(cursor.db).seconds(self.ttl), *ids))
                if cursor.rowcount != len(ids):
                    cursor.execute(st.taken + in_list(ids), (name, *ids))
                    won = {row[0] for row in cursor.fetchall()}
                    rows = [row for row in rows if row[0] in won]
            return [self._claimed(row, name, taken=False) for row in rows]

        self._claim_unsure = True
        jobs = db.run(work, self.using)
        self._claim_unsure = False
        self.stats.claims += 1
        self.stats.claimed += len(jobs)
        return jobs

    @staticmethod
    def _claimed(row: tuple, worker: str, taken: bool) -> ClaimedJob:
        """A claimed row; `taken`: read after the claim, else before it (one less)."""
        step = 0 if taken else 1
        return ClaimedJob(
            id=row[0], priority=row[1], queue=row[3], name=row[4], backend=row[5],
            payload=json.loads(row[6]) if isinstance(row[6], (str, bytes)) else row[6],
            attempt=row[7] + step, max_attempts=row[8], key=row[9], claims=row[10] + step, worker=worker,
            on_finish=row[11], limit_key=row[12], concurrency=row[13], rate=row[14],
        )

    # -- outcomes -----------------------------------------------------------------------

    def _collect(self, wait: float) -> list[Outcome]:
        outcomes = []
        try:
            item = self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait()
        except stdqueue.Empty:
            return outcomes
        while True:
            if not item.job.abandoned:
                outcomes.append(item)
                self.running.pop(item.job.id, None)
            try:
                item = self._done.get_nowait()
            except stdqueue.Empty:
                return outcomes

    def _expire_timeouts(self, threads: _Threads) -> int:
        now = time.monotonic()
        late = [job for job in self.running.values() if job.deadline is not None and job.deadline <= now]
        for job in late:
            job.abandoned = True
            del self.running[job.id]
            threads.add()  # the stuck thread keeps running; its slot gets a new thread
            exc = TimeoutError(f"job ran longer than its timeout of {job.handler.timeout:g}s")
            self._pending.append(_failed(job, exc, retryable=True, delay=job.handler.delay(job.attempt)))
            log.warning("worker %s: job %s #%d timed out (attempt %d)", self.name, job.name, job.id, job.attempt)
        self._flush([])
        return len(late)

    def _flush(self, outcomes: list[Outcome]) -> None:
        """Write the new outcomes with any an earlier database error left pending.

        If the batch fails and the database still answers, one outcome must be at fault
        (a value it refuses, a statement too large): each is then written alone, and one
        refused alone is replaced by a failure saying why, so no outcome blocks the rest.
        """
        self._pending += outcomes
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        if len(batch) > 1:
            try:
                self.finish(batch)
                return
            except (Error, ValueError) as exc:
                if self._outage(exc):
                    self._pending = batch
                    raise
                log.warning("worker %s: writing %d outcomes failed (%s); writing them one by one",
                            self.name, len(batch), exc)
        for index, outcome in enumerate(batch):
            try:
                self._write_alone(outcome)
            except Error:
                self._pending = batch[index:]
                raise

    def _write_alone(self, outcome: Outcome) -> None:
        try:
            self.finish([outcome])
            return
        except (Error, ValueError) as exc:
            if self._outage(exc):
                raise
            refused = exc
        job = outcome.job
        log.error("worker %s: the database refused the outcome of %s #%d (%s); failing the attempt"
                  " with that error instead", self.name, job.name, job.id, refused)
        try:
            self.finish([outcome.refused(refused)])
        except (Error, ValueError) as exc:
            if self._outage(exc):
                raise
            log.error("worker %s: could not record that either (%s): %s #%d is recovered when its lease"
                      " lapses", self.name, exc, job.name, job.id)

    def _outage(self, exc: Exception) -> bool:
        """Whether `exc` came from the database being away rather than from what was sent:
        a transient error, and the database does not answer a trivial query either."""
        if not (isinstance(exc, Error) and db.transient(exc)):
            return False
        try:
            db.run(lambda cursor, resumed: cursor.execute("SELECT 1"), self.using, attempts=2)
        except Error:
            return True
        return False

    def finish(self, outcomes: list[Outcome]) -> None:
        """Write outcomes in one transaction; each only if its claim is still running."""
        wins: dict[str, list[Outcome]] = {}
        followed = []  # succeeded jobs with an on_finish: written one by one, to know which ended
        losses = []
        for outcome in outcomes:
            if outcome.ok and outcome.job.on_finish:
                followed.append(outcome)
            elif outcome.ok:
                wins.setdefault(outcome.result, []).append(outcome)
            else:
                losses.append(outcome)
        grace = self.handler_grace
        written: dict[int, str] = {}

        def work(cursor: Any, resumed: bool) -> None:
            st = statements(cursor.db, "job")
            seconds = db.dialect(cursor.db).seconds
            written.clear()
            ended: list[tuple[int, str, str]] = []
            with db.write_transaction(self.using):
                for result, group in wins.items():
                    params: list = [result]
                    for outcome in group:
                        params += [outcome.job.id, outcome.job.claims]
                    cursor.execute(st.succeed + _pairs(len(group)), params)
                for outcome in followed:
                    job = outcome.job
                    cursor.execute(st.succeed + _pairs(1), (outcome.result, job.id, job.claims))
                    if cursor.rowcount == 1:
                        ended.append((job.id, job.queue, job.on_finish))
                for outcome in losses:
                    job = outcome.job
                    fence = (job.id, job.claims)
                    if outcome.bounce:
                        cursor.execute(st.unhandled, (*fence, seconds(-grace)))
                        if cursor.rowcount != 1:
                            cursor.execute(st.bounce, (seconds(BOUNCE_DELAY), *fence))
                            written[job.id] = "bounced" if cursor.rowcount == 1 else ""
                            continue
                        written[job.id] = "unhandled"
                    elif outcome.retryable and job.attempt < job.max_attempts:
                        cursor.execute(st.retry, (seconds(outcome.delay), *fence))
                        written[job.id] = "retry"
                    else:
                        cursor.execute(st.bury, (Job.DEAD if outcome.retryable else Job.FAILED, *fence))
                        written[job.id] = "dead" if outcome.retryable else "failed"
                    if cursor.rowcount == 1:  # a fenced-out attempt records nothing
                        cursor.execute(st.error, (job.id, job.attempt, *outcome.error, self.name))
                        if written[job.id] != "retry":
                            ended.append((job.id, job.queue, job.on_finish))
                    else:
                        written[job.id] = ""
                jobqueue.follow_ups(cursor, ended)
                limits.free_slots(cursor, [_limits_of(o.job) for o in outcomes if o.job.limit_key], self.using)

        db.run(work, self.using)
        self._report(outcomes, written)

    def _report(self, outcomes: list[Outcome], written: dict[int, str]) -> None:
        """Count outcomes once they are written and log one line each (the job, its queue,
        attempt and run time, and what happened); remember retries due soon."""
        for outcome in outcomes:
            job = outcome.job
            self._finished_keys.add(job.key)
            took = span(outcome.seconds)
            fields = {"job_id": job.id, "job_name": job.name, "queue": job.queue, "attempt": job.attempt,
                      "seconds": round(outcome.seconds, 6)}
            if outcome.ok:
                self.stats.succeeded += 1
                log.info("job %s #%d on %s succeeded in %s (attempt %d/%d)", job.name, job.id, job.queue, took,
                         job.attempt, job.max_attempts, extra={**fields, "outcome": "succeeded"})
                continue
            what = written.get(job.id, "")
            error = f"{outcome.error[0]}: {outcome.error[1]}"
            if what == "bounced":
                self.stats.bounced += 1
                log.warning("worker %s: no handler here for %s #%d (%s); back to the queue in %gs for a worker"
                            " that has it (it fails after %gs without one)", self.name, job.name, job.id,
                            outcome.error[1], BOUNCE_DELAY, self.handler_grace, extra={**fields, "outcome": "bounced"})
                continue
            self.stats.failed += 1
            if what == "retry":
                if outcome.delay <= BURST_RETRY_WAIT:
                    self._retries_until = max(self._retries_until, time.monotonic() + outcome.delay + 1.0)
                log.warning("job %s #%d on %s failed in %s (attempt %d/%d), retry in %.1fs: %s", job.name, job.id,
                            job.queue, took, job.attempt, job.max_attempts, outcome.delay, error,
                            extra={**fields, "outcome": "retry", "retry_in": round(outcome.delay, 3)})
            elif what == "unhandled":
                log.error("job %s #%d on %s failed, not retried: no worker had its handler for %gs", job.name, job.id,
                          job.queue, self.handler_grace, extra={**fields, "outcome": "failed"})
            elif what:
                # "dead": out of attempts; "failed": not to be retried (Fail, BadResult)
                words = "dead: out of attempts" if what == "dead" else "not retried"
                log.error("job %s #%d on %s failed in %s (attempt %d/%d), %s: %s", job.name, job.id, job.queue,
                          took, job.attempt, job.max_attempts, words, error, extra={**fields, "outcome": what})

    def hand_back(self) -> int:
        """Put every attempt still running under this worker's name back to ready, without
        using up a try: the unfinished ones, and any whose claim reply was lost."""
        for job in self.running.values():
            job.abandoned = True
        keep = [outcome.job.id for outcome in self._pending]  # finished: never run twice
        params: list = [self.name, *keep]
        rest = " AND id NOT IN (" + in_list(keep) if keep else ""

        def work(cursor: Any, resumed: bool) -> int:
            st = statements(cursor.db, "job")
            with db.write_transaction(self.using):
                cursor.execute(st.handed_keys + rest, params)  # whose slots come free
                keys = cursor.fetchall()
                cursor.execute(st.hand_back + rest, params)
                count = cursor.rowcount
                limits.free_slots(cursor, keys, self.using)
            return count

        count = db.run(work, self.using)
        self.running.clear()
        self._claim_unsure = False
        log.warning("worker %s: handed %d unfinished job(s) back to the queue", self.name, count)
        return count

    # -- heartbeat, recovery, history ---------------------------------------------------

    def _ours(self) -> list[int]:
        """Jobs this worker runs or has finished without writing: their leases are its."""
        return [*self.running, *(outcome.job.id for outcome in self._pending)]

    def heartbeat(self) -> None:
        """Renew the worker's lease and the leases of the jobs it runs, and only those."""
        assert self.hold is not None
        try:
            self.hold.renew()
        except LeaseLost:
            old = self.name
            log.error("worker %s: its lease lapsed (stalled longer than %.0fs); registering again", old, self.ttl)
            self.register()
            self._adopt(old)
        ids = self._ours()
        if not ids:
            return
        name = self.name

        def work(cursor: Any, resumed: bool) -> None:
            sql = statements(cursor.db, "job").extend + in_list(ids)
            cursor.execute(sql, (db.dialect(cursor.db).seconds(self.ttl), name, *ids))

        db.run(work, self.using)

    def _adopt(self, old: str) -> None:
        """Running jobs still under the lapsed name were not recovered: keep them as ours."""
        name = self.name

        def work(cursor: Any, resumed: bool) -> None:
            cursor.execute(statements(cursor.db, "job").adopt, (name, old))

        db.run(work, self.using)
        for job in self.running.values():
            job.worker = name
        for outcome in self._pending:
            outcome.job.worker = name

    def recover(self) -> int:
        """Put back the jobs of workers whose heartbeat lapsed: ready, or dead when out of
        attempts. Any live worker does this; SKIP LOCKED keeps them from colliding. This
        worker's own jobs are left alone when it still runs them (its heartbeat was late)."""
        total = recover_lapsed(self.using, by=f"worker {self.name}", keep=set(self._ours()), worker=self.name)
        self.stats.recovered += total
        self._limited(limits.unblock_pass(self.using))
        return total

    def _limited(self, blocked: dict[str, int]) -> None:
        """Say now and then which keys hold jobs back, and how many."""
        now = time.monotonic()
        if not blocked or now < self._next_limit_log:
            return
        self._next_limit_log = now + LIMIT_LOG_EVERY
        busiest = sorted(blocked.items(), key=lambda item: -item[1])[:10]
        log.info("worker %s: keys at their concurrency limit (jobs waiting): %s", self.name,
                 ", ".join(f"{key} ({count})" for key, count in busiest))

    def trim(self) -> None:
        """Keep only the newest LEASES_KEEP_RUNS finished runs of the keys that just ran."""
        keys, self._finished_keys = self._finished_keys, set()
        if keys:
            jobqueue.trim_runs(keys, using=self.using)


def database_of(queues: list[str], using: str | None = None) -> str:
    """The one database `queues` live on: `using`, else their routes'; ValueError when
    the routes send them to several."""
    if using or queues == ["*"]:
        return routing.known(using) if using else db.alias()
    found = {name: routing.route("queues", name) for name in queues}
    if len(set(found.values())) > 1:
        spread = ", ".join(f"{name} on {alias}" for name, alias in sorted(found.items()))
        raise ValueError(f"queues live on several databases ({spread}): one worker serves one database")
    return next(iter(found.values()))


def recover_lapsed(using: str, by: str, ids: list[int] | None = None, keep: set[int] | None = None,
                   worker: str = "") -> int:
    """Put back jobs whose worker stopped heartbeating (their lease lapsed, by the database
    clock): ready again, or dead when out of attempts, each with a WorkerLost error naming
    `by`; their keys' slots come back in the same transaction. `ids` limits it to those
    jobs (an operator's choice); `keep` are jobs of `worker` it still runs. Returns how many."""
    keep = keep or set()

    def work(cursor: Any, resumed: bool) -> tuple[int, bool, list[str]]:
        """(jobs recovered, whether a full batch was read and more may wait, their names)."""
        named: list[str] = []
        st = statements(cursor.db, "job")
        with db.write_transaction(using):
            if ids is None:
                cursor.execute(st.lapsed, (RECOVER_BATCH,))
            else:
                cursor.execute(st.lapsed_in + in_list(ids), ids)
            lapsed = cursor.fetchall()
            recovered = 0
            freed = []
            for job_id, claims, attempt, owner, max_attempts, queue, on_finish, *limited, job_name in lapsed:
                if owner == worker and job_id in keep:
                    continue
                cursor.execute(st.recover, (job_id, claims))
                if cursor.rowcount == 1:
                    recovered += 1
                    freed.append(tuple(limited))
                    fate = "dead, out of attempts" if attempt >= max_attempts else "ready again"
                    named.append(f"{job_name} #{job_id} of {owner} ({fate})")
                    message = f"worker {owner} stopped heartbeating; recovered by {by}"
                    cursor.execute(st.error, (job_id, attempt, *describe(WorkerLost(message))[:2], "", owner))
                    if attempt >= max_attempts:  # dead: it ended for good
                        jobqueue.follow_ups(cursor, [(job_id, queue, on_finish)])
            limits.free_slots(cursor, freed, using)  # a crashed worker's slots come back now
        return recovered, ids is None and len(lapsed) == RECOVER_BATCH and recovered > 0, named

    total, more = 0, True
    named: list[str] = []
    if ids is None:
        forget_workers(FORGET_AFTER, using)
    while more:
        count, more, names = db.run(work, using)
        total += count
        named += names
    if total:
        log.warning("%s recovered %d job(s) whose worker stopped heartbeating: %s", by, total,
                    ", ".join(named[:20]) + (f" and {len(named) - 20} more" if len(named) > 20 else ""))
    return total


def forget_workers(older_than: float, using: str | None = None) -> int:
    """Delete the rows of workers gone (stopped, or their heartbeat lapsed) for more than
    `older_than` seconds, by the database clock; live workers do this after a day."""

    def work(cursor: Any, resumed: bool) -> int:
        cursor.execute(statements(cursor.db, "worker").forget, (db.dialect(cursor.db).seconds(-older_than),))
        return cursor.rowcount

    return db.run(work, using)
