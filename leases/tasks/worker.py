"""The pull-on-demand worker behind `manage.py leases_worker`.

One main thread talks to the database; `concurrency` threads run handlers. The main
thread claims only as many jobs as there are free threads (the seed's control tokens),
in one short transaction (`FOR UPDATE SKIP LOCKED`, or SQLite's immediate transaction),
and writes the outcomes of finished jobs in one transaction per loop.

Crash safety: the worker's process row is a lease renewed by its heartbeat, and each
running job carries a lease (`expires_at`) the same heartbeat extends. When a worker
stops heartbeating, any live worker puts its jobs back to ready (or dead, when no attempt
is left). Every outcome names the attempt it ends, so a late finisher writes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import queue as stdqueue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, close_old_connections, connections

from leases import db
from leases.exceptions import Fail, LeaseLost, UnknownHandler, WorkerLost
from leases.lease import Hold, make_holder
from leases.sql import statements

from . import queue as jobqueue
from . import registry
from .models import Job

log = logging.getLogger("leases.tasks.worker")

#: Seconds between recoveries of lapsed jobs (the ttl bounds how stale they can be).
RECOVER_EVERY = 5.0
#: Seconds between trims of keys' old runs.
TRIM_EVERY = 10.0
#: Lapsed jobs recovered per statement batch.
RECOVER_BATCH = 100
#: Worker rows gone this long are deleted.
FORGET_AFTER = 86400.0


def _class_path(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def _pairs(count: int) -> str:
    return jobqueue._pairs(count)


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
    worker: str = ""
    #: Set by the main thread when the attempt timed out: its outcome is already written.
    abandoned: bool = False
    deadline: float | None = None


@dataclass
class Outcome:
    job: ClaimedJob
    ok: bool
    result: str = "null"
    error: tuple[str, str, str] | None = None
    #: False for Fail and for a job no handler here can run: no retry.
    retryable: bool = True
    #: Seconds before the next attempt (from the handler's backoff).
    delay: float = 0.0


def handler_for(job: ClaimedJob) -> Any:
    """The object that runs `job`: a registered handler, or a Django Tasks task."""
    if job.backend:
        from .backend import task_handler

        return task_handler(job)
    return registry.get(job.name)


def execute(job: ClaimedJob) -> Outcome:
    """Run one attempt; any exception becomes the attempt's error, never the worker's."""
    close_old_connections()
    try:
        spec = handler_for(job)
    except (UnknownHandler, ImportError, ValueError, ImproperlyConfigured) as exc:
        return _failed(job, exc, retryable=False, delay=0.0)
    try:
        value = spec.run(job)
        return Outcome(job, ok=True, result=jobqueue.dump_payload(value))
    except Fail as exc:
        return _failed(job, exc, retryable=False, delay=0.0)
    except BaseException as exc:  # noqa: BLE001 - a handler must never kill the worker
        return _failed(job, exc, retryable=True, delay=spec.delay(job.attempt))
    finally:
        close_old_connections()


def _failed(job: ClaimedJob, exc: BaseException, retryable: bool, delay: float) -> Outcome:
    trace = "".join(traceback.format_exception(exc))
    return Outcome(job, ok=False, error=(_class_path(exc), str(exc), trace), retryable=retryable, delay=delay)


class WorkerHold(Hold):
    """The worker's process row, held as a lease and renewed by its heartbeat."""

    kind = "worker"

    def __str__(self) -> str:
        return f"worker {self.holder}"


class _Threads:
    """`size` threads running handlers; a timed-out job's thread is replaced, and exits
    when its handler finally returns."""

    def __init__(self, size: int, done: stdqueue.SimpleQueue) -> None:
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
    claims: int = 0
    started: float = field(default_factory=time.monotonic)


class Worker:
    """A worker process: `run()` until stopped, out of work (`burst`) or `max_jobs` done.

    `queues` is a list of names or ["*"] for all. `stop()` (SIGTERM) stops claiming and
    lets running jobs finish for up to `grace` seconds, then hands the rest back to ready.
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
    ) -> None:
        self.queues = list(queues)
        self.all_queues = self.queues == ["*"]
        self.concurrency = concurrency
        self.poll = poll
        self.ttl = ttl
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.using = db.alias(using)
        self.stats = Stats()
        self.running: dict[int, ClaimedJob] = {}
        self.hold: WorkerHold | None = None
        self._done: stdqueue.SimpleQueue = stdqueue.SimpleQueue()
        self._stop_at: float | None = None
        self._stop_requests = 0
        self._active: tuple[float, list[str]] = (0.0, [])
        self._finished_keys: set[str] = set()
        self._pending: list[Outcome] = []

    @property
    def name(self) -> str:
        return self.hold.holder if self.hold else ""

    # -- life cycle ---------------------------------------------------------------------

    def register(self) -> None:
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
        if self.hold is None:
            self.register()
        threads = _Threads(self.concurrency, self._done)
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
                    claimed = self._claim_free(threads)
                    timed_out = self._expire_timeouts(threads)
                    outcomes = self._collect(wait=0)
                    self._flush(outcomes)
                    if self._should_exit(claimed + timed_out + len(outcomes)):
                        break
                    self._flush(self._collect(wait=self._wait_time()))
                except DatabaseError as exc:
                    # Outcomes not yet written stay pending; the heartbeat keeps their
                    # jobs ours meanwhile. Beyond the ttl they are recovered elsewhere.
                    log.error("worker %s: database error, retrying in 1s: %s", self.name, exc)
                    time.sleep(1.0)
            if self.running:
                self.hand_back()
            self.trim()
        finally:
            self._shutdown(threads)
        return self.stats

    def _should_exit(self, busy: int) -> bool:
        """`busy`: jobs claimed or finished in this round (burst mode goes on while any)."""
        if self.stopping:
            if not self.running:
                return True
            return time.monotonic() >= self._stop_at
        if self.max_jobs is not None and self.stats.claimed >= self.max_jobs and not self.running:
            return True
        return self.burst and not busy and not self.running

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
        if self.hold is not None and not self.hold.lost:
            try:
                self.hold.release()
            except Exception:  # noqa: BLE001 - the row lapses on its own
                log.warning("worker %s: could not release its row", self.name, exc_info=True)
        log.info(
            "worker %s stopped: %d claimed, %d succeeded, %d failed, %d recovered",
            self.name, self.stats.claimed, self.stats.succeeded, self.stats.failed, self.stats.recovered,
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
            self.running[job.id] = job
            timeout = self._timeout(job)
            job.deadline = now + timeout if timeout else None
            threads.submit(job)
        return len(jobs)

    @staticmethod
    def _timeout(job: ClaimedJob) -> float | None:
        try:
            return handler_for(job).timeout
        except Exception:  # noqa: BLE001 - execute() reports the missing handler
            return None

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs, highest priority first, then oldest run time."""
        active = self.active_queues()
        if not active:
            return []
        name = self.name

        def work(cursor: Any, resumed: bool) -> list[ClaimedJob]:
            st = statements(cursor.db, "job")
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
                ids = [row[0] for row in rows]
                cursor.execute(st.take + jobqueue._in(ids), (name, db.dialect(cursor.db).seconds(self.ttl), *ids))
                if cursor.rowcount != len(ids):
                    cursor.execute(st.taken + jobqueue._in(ids), (name, *ids))
                    won = {row[0] for row in cursor.fetchall()}
                    rows = [row for row in rows if row[0] in won]
            return [
                ClaimedJob(
                    id=row[0], priority=row[1], queue=row[3], name=row[4], backend=row[5],
                    payload=json.loads(row[6]) if isinstance(row[6], (str, bytes)) else row[6],
                    attempt=row[7] + 1, max_attempts=row[8], key=row[9], worker=name,
                )
                for row in rows
            ]

        jobs = db.run(work, self.using)
        self.stats.claims += 1
        self.stats.claimed += len(jobs)
        return jobs

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
        outcomes = []
        for job in late:
            job.abandoned = True
            del self.running[job.id]
            threads.add()  # the stuck thread keeps running; its slot gets a new thread
            exc = TimeoutError(f"job ran longer than its timeout of {self._timeout(job)}s")
            outcomes.append(_failed(job, exc, retryable=True, delay=handler_for(job).delay(job.attempt)))
            log.warning("worker %s: job %s #%d timed out (attempt %d)", self.name, job.name, job.id, job.attempt)
        self._flush(outcomes)
        return len(outcomes)

    def _flush(self, outcomes: list[Outcome]) -> None:
        """Write the new outcomes with any an earlier database error left pending."""
        self._pending += outcomes
        if self._pending:
            self.finish(self._pending)
            self._pending = []

    def finish(self, outcomes: list[Outcome]) -> None:
        """Write outcomes in one transaction; each only if its attempt is still running."""
        wins: dict[str, list[Outcome]] = {}
        losses = []
        for outcome in outcomes:
            if outcome.ok:
                wins.setdefault(outcome.result, []).append(outcome)
            else:
                losses.append(outcome)

        def work(cursor: Any, resumed: bool) -> int:
            st = statements(cursor.db, "job")
            seconds = db.dialect(cursor.db).seconds
            written = 0
            with db.write_transaction(self.using):
                for result, group in wins.items():
                    params: list = [result]
                    for outcome in group:
                        params += [outcome.job.id, outcome.job.attempt]
                    cursor.execute(st.succeed + _pairs(len(group)), params)
                    written += cursor.rowcount
                for outcome in losses:
                    job = outcome.job
                    if outcome.retryable and job.attempt < job.max_attempts:
                        cursor.execute(st.retry, (seconds(outcome.delay), job.id, job.attempt))
                    else:
                        status = Job.DEAD if outcome.retryable else Job.FAILED
                        cursor.execute(st.bury, (status, job.id, job.attempt))
                    if cursor.rowcount == 1:  # a fenced-out attempt records nothing
                        cursor.execute(st.error, (job.id, job.attempt, *outcome.error, self.name))
            return written

        db.run(work, self.using)
        self.stats.succeeded += sum(len(group) for group in wins.values())
        self.stats.failed += len(losses)
        for outcome in outcomes:
            self._finished_keys.add(outcome.job.key)
            if not outcome.ok:
                log.warning(
                    "job %s #%d attempt %d/%d failed: %s: %s", outcome.job.name, outcome.job.id,
                    outcome.job.attempt, outcome.job.max_attempts, outcome.error[0], outcome.error[1],
                )

    def hand_back(self) -> int:
        """Put the attempts still running back to ready (shutdown after the grace period)."""
        jobs = list(self.running.values())
        params: list = [self.name]
        for job in jobs:
            job.abandoned = True
            params += [job.id, job.attempt]

        def work(cursor: Any, resumed: bool) -> int:
            cursor.execute(statements(cursor.db, "job").hand_back + _pairs(len(jobs)), params)
            return cursor.rowcount

        count = db.run(work, self.using)
        self.running.clear()
        log.warning("worker %s: handed %d unfinished job(s) back to the queue", self.name, count)
        return count

    # -- heartbeat, recovery, history ---------------------------------------------------

    def heartbeat(self) -> None:
        """Renew the worker's lease and the leases of its running jobs."""
        assert self.hold is not None
        try:
            self.hold.renew()
        except LeaseLost:
            old = self.name
            log.error("worker %s: its lease lapsed (stalled longer than %.0fs); registering again", old, self.ttl)
            self.register()
            self._adopt(old)
        name = self.name

        def work(cursor: Any, resumed: bool) -> None:
            cursor.execute(statements(cursor.db, "job").extend, (db.dialect(cursor.db).seconds(self.ttl), name))

        db.run(work, self.using)

    def _adopt(self, old: str) -> None:
        """Running jobs still under the lapsed name were not recovered: keep them as ours."""
        name = self.name

        def work(cursor: Any, resumed: bool) -> None:
            cursor.execute(statements(cursor.db, "job").adopt, (name, old))

        db.run(work, self.using)
        for job in self.running.values():
            job.worker = name

    def recover(self) -> int:
        """Put back the jobs of workers whose heartbeat lapsed: ready, or dead when out of
        attempts. Any live worker does this; SKIP LOCKED keeps them from colliding."""

        def work(cursor: Any, resumed: bool) -> int:
            st = statements(cursor.db, "job")
            with db.write_transaction(self.using):
                cursor.execute(st.lapsed, (RECOVER_BATCH,))
                lapsed = cursor.fetchall()
                recovered = 0
                for job_id, attempt, worker in lapsed:
                    cursor.execute(st.recover, (job_id, attempt))
                    if cursor.rowcount == 1:
                        recovered += 1
                        message = f"worker {worker} stopped heartbeating; recovered by {self.name}"
                        cursor.execute(st.error, (job_id, attempt, _class_path(WorkerLost()), message, "", worker))
                cursor.execute(statements(cursor.db, "worker").forget, (db.dialect(cursor.db).seconds(-FORGET_AFTER),))
            return recovered

        total = 0
        while (count := db.run(work, self.using)) > 0:
            total += count
            if count < RECOVER_BATCH:
                break
        if total:
            log.warning("worker %s recovered %d job(s) of lapsed workers", self.name, total)
        self.stats.recovered += total
        return total

    def trim(self) -> None:
        """Keep only the newest LEASES_KEEP_RUNS finished runs of the keys that just ran."""
        keys, self._finished_keys = self._finished_keys, set()
        if keys:
            jobqueue.trim_runs(keys, using=self.using)
