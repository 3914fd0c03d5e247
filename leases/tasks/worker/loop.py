"""The worker behind `manage.py leases_worker`: a process loop of timed duties, and no SQL.

One main thread talks to the database, through the stages of `leases.tasks.jobs`;
`concurrency` threads run handlers (`threads`). The main thread claims only as many jobs
as there are free threads (a control token per thread) and writes the outcomes of finished
jobs in the same transaction as its next claim: one commit per turn. Between claims it
does its duties on their timers (`duties`): the heartbeat, recovery of other workers'
lapsed jobs, trims of finished runs, and, if it leads, the scheduler's passes.

An outcome the database refuses fails its job with that error instead of blocking the
others; during an outage outcomes wait, and the heartbeat keeps their jobs ours.

A worker that does not serve a handler's queue says so when it starts, and a `--burst`
worker that found nothing to do while jobs are due elsewhere says where before it exits
(one grouped read then, none per poll).
"""
from __future__ import annotations

import logging
import os
import queue as stdqueue
import time
from typing import Callable, Iterable, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import Error, connections

from leases import conf, db, routing
from leases.exceptions import Cancelled, UnknownHandler
from leases.validation import check_seconds

from .. import registry
from ..jobs import claim as claims
from ..jobs import counts, handoff, leasing, outcomes, recovery
from ..jobs.claim import ClaimedJob
from ..jobs.outcomes import Outcome, describe, failed
from ..jobs.queues import SETTINGS_TTL, all_queues
from ..schedules.leader import Scheduler
from . import report
from .duties import Duty, TimedDuties
from .report import BURST_RETRY_WAIT, Stats
from .threads import Threads, handler_for
from .wakeup import Wakeup

log = logging.getLogger("leases.tasks.worker")

T = TypeVar("T")

#: Shortest worker ttl: the heartbeat runs between claims and outcome writes, and one
#: slow commit must not let a running job's lease lapse.
MIN_TTL = 1.0
#: Under a backlog (the last claim got all it asked for), seconds a claim may wait for
#: half the threads to come free, so that a turn claims (and commits outcomes) by the
#: batch rather than once per finished job.
GATHER = 0.002
#: Seconds between polls while a listen connection is up (PostgreSQL): pushes wake the
#: loop at once, and the polls find jobs that came due later (a delay, a retry).
LISTENING_POLL = 1.0


class JobWorker(TimedDuties):
    """A worker: `run()` until stopped, out of work (`burst`) or `max_jobs` done.

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
        listen: bool = True,
    ) -> None:
        self.queues = list(queues)
        self.all_queues = self.queues == ["*"]
        self.concurrency = concurrency
        self.poll = poll
        self.ttl = check_seconds(ttl, "ttl", minimum=MIN_TTL)
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace = grace
        self.using = routing.database_of(self.queues, using)
        self.handler_grace = conf.handler_grace()
        self.stats = Stats()
        self.running: dict[int, ClaimedJob] = {}
        self.hold: recovery.WorkerHold | None = None
        #: Jobs of handlers this process lacks (see leases.tasks.jobs.handoff).
        self.lacking = handoff.Lacking(self.using)
        #: Pools whose resources this worker's jobs may hold (see leases.tasks.jobs.leasing).
        self.pools = leasing.pools_of(self.queues)
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
        #: The database error of the loop's last turn (None: it went through).
        self._unreachable: BaseException | None = None
        #: When a --burst worker may leave: its own retries due soon have run by then.
        self._retries_until = 0.0
        #: The last claim got all it asked for: more may be due, so the next turn claims
        #: at once instead of waiting for a poll or a notification (they are for an
        #: empty queue: a drain pushes nothing, so no notification would come).
        self._claimed_full = False
        #: Since when threads are free and a claim waits for more (GATHER).
        self._free_since: float | None = None
        self._next_limit_log = 0.0
        self._next_wait_look = 0.0
        #: Takes part in leading the scheduler (leases_worker does unless --no-schedule).
        self.schedule = schedule
        self.scheduler: Scheduler | None = None
        #: Wake at once on pushes where the database can notify (`wakeup`).
        self.listen = listen
        self.wakeup: Wakeup | None = None

    @property
    def name(self) -> str:
        return self.hold.holder if self.hold else ""

    # -- life cycle ---------------------------------------------------------------------

    def register(self) -> recovery.WorkerHold:
        """Insert this process's row, naming the handlers it has, and hold it as a lease;
        take over the jobs other workers handed back for want of one of them."""
        handlers = sorted(registry.registered())
        self.hold = recovery.register_worker(self.queues, self.concurrency, self.ttl, self.using, handlers)
        log.info("worker %s started: queues %s, concurrency %d", self.name, ",".join(self.queues), self.concurrency)
        report.took_over(self.name, handoff.take_over(handlers, self.queues, self.using))
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
        """Serve until stop(), a signal, `max_jobs` or (burst) empty queues; hand back
        jobs claimed but not started, let running ones finish, and return the counts."""
        if self.hold is None and self.when_up(self.register) is None:
            return self.stats
        unserved = self.unserved_handlers()
        if unserved:
            report.unserved(self.name, self.queues, unserved)
        threads = Threads(self.concurrency, self._done)
        duties = self._duties()
        if self.listen:
            self.wakeup = Wakeup(self.name, self.using, self.queues, lambda: self._done.put(None))
            self.wakeup.start()
        try:
            while True:
                try:
                    done = self._turn(threads, duties)
                except db.driver_errors(self.using) as exc:
                    # Outcomes not yet written stay pending, and the heartbeat keeps their
                    # jobs ours once it gets through. Beyond the ttl they are recovered.
                    # A driver's own error means Django's wrapping missed a call: say where.
                    log.error("worker %s: database error, retrying in 1s: %s", self.name, exc,
                              exc_info=not isinstance(exc, Error))
                    db.drop_if_broken(connections[self.using])
                    self._unreachable = exc
                    if self.stopping and (time.monotonic() >= self._stop_at or not self.running and not self._pending):
                        break  # nothing left to wait for: what it holds lapses (see _shutdown)
                    time.sleep(1.0)
                    continue
                self._unreachable = None
                if done:
                    break
            if self._unreachable is None:
                self._leave()
                self._say_what_waits()
        finally:
            self._shutdown(threads)
        return self.stats

    def _turn(self, threads: Threads, duties: list[Duty]) -> bool:
        """One turn of the loop: duties due, claims, timeouts, outcomes, then a wait for
        outcomes. True when the worker should exit."""
        now = time.monotonic()
        for duty in duties:
            duty.run_if_due(now, self.stopping)
        finished = self._collect(wait=0)
        self._pending += finished
        claimed = self._claim_free(threads)  # writes the outcomes pending in its transaction
        timed_out = self._expire_timeouts(threads)
        if self._free_since is None or self.stopping:  # no claim comes within GATHER to carry them
            self._flush([])
        if self._should_exit(claimed + timed_out + len(finished)):
            return True
        self._pending += self._collect(wait=self._wait_time(duties))
        return False

    def _leave(self) -> None:
        """On the way out: write what finished, hand back the rest, trim; best effort, as
        what is left lapses and is recovered by other workers."""
        try:
            self._flush([])
            if self.running or self._claim_unsure:
                self.hand_back()
            self.trim()
        except Error as exc:
            if db.transient(exc):
                self._unreachable = exc  # said once, with the row it cannot release either
                return
            log.error("worker %s: could not hand back its jobs (%s); they are recovered when their"
                      " leases lapse", self.name, exc)

    def _should_exit(self, busy: int) -> bool:
        """`busy`: jobs claimed or finished in this turn (burst mode goes on while any)."""
        if self.stopping:
            if not self.running:
                return True
            return time.monotonic() >= self._stop_at
        if self._max_reached() and not self.running:
            return True
        if not self.burst or busy or self.running or self._pending:
            return False
        return time.monotonic() >= self._retries_until

    def _wait_time(self, duties: list[Duty]) -> float:
        free = self.concurrency - len(self.running)
        if self._claimed_full and free > 0 and not self.stopping and not self._max_reached():
            return 0.0 if self._free_since is None else max(0.0, self._free_since + GATHER - time.monotonic())
        wait = self.poll
        if self.wakeup is not None and self.wakeup.listening.is_set():
            wait = max(self.poll, LISTENING_POLL)
        if free <= 0 or self.stopping or self._max_reached():
            wait = max(self.poll, 0.5)  # nothing to claim: wake for outcomes, beats, deadlines
        # Wake for the next deadline of a job, duty (a heartbeat, a scheduler's pass) or stop.
        moments = [job.deadline for job in self.running.values() if job.deadline is not None]
        moments += [duty.due for duty in duties if duty.applies(self.stopping)]
        if self._stop_at is not None:
            moments.append(self._stop_at)
        return min([wait] + [max(0.0, moment - time.monotonic()) for moment in moments])

    def _max_reached(self) -> bool:
        return self.max_jobs is not None and self.stats.claimed >= self.max_jobs

    def _shutdown(self, threads: Threads) -> None:
        threads.stop()
        if self.wakeup is not None:
            self.wakeup.stop()
        self._give_up()
        report.stopped(self.name, self.stats)

    def _give_up(self) -> None:
        """Give up the scheduler's lead and the worker's row, so others need not wait for
        them to lapse. With the database away (the loop or the hand-back just met it), not
        tried: one line says what lapses instead, as the jobs still ours do."""
        left = len(self.running) + len(self._pending)
        self.stats.lapsed += left
        leading = self.scheduler is not None and self.scheduler.lead is not None
        if self.hold is None or self.hold.lost:
            return
        if self._unreachable is None:
            try:
                if self.scheduler is not None:
                    self.scheduler.stop()
                self.hold.release()
                return
            except Error as exc:
                self._unreachable = exc
        report.left_unreleased(self.name, self.ttl, leading, left, self._unreachable)

    def unserved_handlers(self) -> list[registry.Handler]:
        """Handlers whose jobs go to a queue of this worker's database that it does not
        serve; not internal ones, whose jobs go to the queue of what they serve."""
        if self.all_queues:
            return []
        return [spec for _, spec in sorted(registry.registered().items())
                if not spec.internal and spec.queue not in self.queues
                and routing.route("queues", spec.queue) == self.using]

    def _say_what_waits(self) -> None:
        """A --burst worker that claimed nothing: are jobs due on queues it does not serve?
        Best effort, one grouped read."""
        if not self.burst or self.all_queues or self.stats.claimed or self.stopping:
            return
        try:
            due = counts.due_elsewhere(self.queues, self.using)
        except Error as exc:
            log.debug("worker %s: could not count the jobs due elsewhere: %s", self.name, exc)
            return
        if due:
            report.due_elsewhere(self.name, self.queues, due)

    # -- claiming -----------------------------------------------------------------------

    def active_queues(self) -> list[str]:
        """The queues to claim from now: not paused; for "*", every known queue."""
        now = time.monotonic()
        if self._active[0] > now:
            return self._active[1]
        rows = all_queues(self.using)
        if self.all_queues:
            names = set(rows) | {spec.queue for spec in registry.registered().values()}
        else:
            names = set(self.queues)
        active = sorted(name for name in names if not (name in rows and rows[name].paused))
        self._active = (now + SETTINGS_TTL, active)
        return active

    def _claim_free(self, threads: Threads) -> int:
        """Claim as many jobs as threads are free and hand them to the threads."""
        if self.stopping:
            return 0
        free = self.concurrency - len(self.running)
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        if self._gathering() or free <= 0:
            return 0
        jobs = self.claim(free)
        self._claimed_full = len(jobs) >= free
        now = time.monotonic()
        for job in jobs:
            try:
                job.handler = handler_for(job)
            except (UnknownHandler, ImportError, ImproperlyConfigured) as exc:
                # Not deployed here (yet): back to the queue for a worker that has it.
                self._pending.append(self.lacking.give_back(self.name, job, exc))
                continue
            except Exception:  # noqa: BLE001 - execute() fails the attempt with this error
                pass
            self.running[job.id] = job
            timeout = getattr(job.handler, "timeout", None)
            job.deadline = now + timeout if timeout else None
            threads.submit(job)
        return len(jobs)

    def _gathering(self) -> bool:
        """Whether a claim waits for more threads to come free (see GATHER)."""
        if not self._claimed_full or 2 * (self.concurrency - len(self.running)) >= self.concurrency:
            self._free_since = None
            return False
        now = time.monotonic()
        if self._free_since is None:
            self._free_since = now
        if now - self._free_since < GATHER:
            return True
        self._free_since = None
        return False

    def claim(self, limit: int) -> list[ClaimedJob]:
        """Claim up to `limit` due jobs, highest priority first, then oldest run time; after
        a claim whose outcome is unknown (the connection died, maybe after COMMIT), first
        take back what runs under this worker's name and is not known here."""
        active = self.active_queues()
        if not active and not self._claim_unsure:
            return []
        known = frozenset(self.running) | {outcome.job.id for outcome in self._pending}
        unsure = self._claim_unsure
        ending = self._ending() if not unsure else None
        self._claim_unsure = True
        try:
            jobs, delayed = claims.claim(self.name, active, limit, self.ttl, self.using, unsure, known,
                                         self.lacking.skipped(), self.pools, ending and ending.write)
        except (Error, ValueError) as exc:
            if ending is None or self._outage(exc):
                raise
            log.warning("worker %s: writing %d outcomes with a claim failed (%s); writing them apart",
                        self.name, len(ending.outcomes), exc)
            self._flush([])
            jobs, delayed = claims.claim(self.name, active, limit, self.ttl, self.using, True, known,
                                         self.lacking.skipped(), self.pools)
        else:
            if ending is not None:
                self._pending = []
                self._written(ending.outcomes, ending.written)
        self._claim_unsure = False
        if delayed is not None and delayed <= BURST_RETRY_WAIT:  # --burst waits for them
            self._retries_until = max(self._retries_until, time.monotonic() + delayed + 1.0)
        self.stats.claims += 1
        self.stats.claimed += len(jobs)
        return jobs

    def _ending(self) -> outcomes.Ending | None:
        """The pending outcomes, to write in the next claim's transaction; None when none
        are pending or some take locks a claim does not (they are written apart first)."""
        if not self._pending:
            return None
        ending = outcomes.Ending(self._pending, self.name, self.handler_grace, self.using)
        if ending.simple:
            return ending
        self._flush([])
        return None

    # -- outcomes -----------------------------------------------------------------------

    def _collect(self, wait: float) -> list[Outcome]:
        found = []
        try:
            item = self._done.get(timeout=wait) if wait > 0 else self._done.get_nowait()
        except stdqueue.Empty:
            return found
        while True:
            if item is not None and not item.job.abandoned:  # None: a push woke the loop
                found.append(item)
                self.running.pop(item.job.id, None)
            try:
                item = self._done.get_nowait()
            except stdqueue.Empty:
                return found

    def _expire_timeouts(self, threads: Threads) -> int:
        """Abandon the attempts past their timeout, or cancelled and still running past the
        grace: each stuck thread keeps running, its slot gets a new one (an async attempt
        is cancelled), the outcome is written now (a late one is fenced out)."""
        now = time.monotonic()
        late = [job for job in self.running.values() if (job.deadline is not None and job.deadline <= now)
                or (job.cancel_seen_at is not None and job.cancel_seen_at + self.grace <= now)]
        for job in late:
            job.abandoned = True
            del self.running[job.id]
            threads.abandon(job)
            if job.deadline is not None and job.deadline <= now:
                exc = TimeoutError(f"job ran longer than its timeout of {job.handler.timeout:g}s")
                self._pending.append(failed(job, exc, retryable=True, delay=job.handler.delay(job.attempt)))
                log.warning("worker %s: job %s #%d timed out (attempt %d)", self.name, job.name, job.id, job.attempt)
            else:
                exc = Cancelled(f"cancelled while it ran, and still running {self.grace:g}s later: abandoned")
                self._pending.append(Outcome(job, ok=False, error=describe(exc), cancelled=True))
        if late:
            self._flush([])
        return len(late)

    def _flush(self, finished: list[Outcome]) -> None:
        """Write the new outcomes with any an earlier database error left pending.

        If the batch fails and the database still answers, one outcome must be at fault
        (a value it refuses, a statement too large): each is then written alone, and one
        refused alone is replaced by a failure saying why, so no outcome blocks the rest.
        """
        self._pending += finished
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
            self.stats.unrecorded += 1

    def _outage(self, exc: Exception) -> bool:
        """Whether `exc` came from the database being away rather than from what was sent:
        a transient error, and the database does not answer a trivial query either."""
        return isinstance(exc, Error) and db.transient(exc) and not db.answers(self.using)

    def finish(self, done: list[Outcome]) -> None:
        """Write outcomes in one transaction (each only if its claim is still running), then
        count and log them."""
        self._written(done, outcomes.write_outcomes(done, self.name, self.handler_grace, self.using))

    def _written(self, done: list[Outcome], written: dict[int, str]) -> None:
        self.lacking.written(self.name, done, written)
        self._finished_keys.update(outcome.job.key for outcome in done)
        stay = report.outcomes_written(self.name, done, written, self.stats, self.handler_grace)
        self._retries_until = max(self._retries_until, stay)

    def hand_back(self) -> int:
        """Put every attempt still running under this worker's name back to ready, without
        using up a try: the unfinished ones, and any whose claim reply was lost."""
        for job in self.running.values():
            job.abandoned = True
        keep = [outcome.job.id for outcome in self._pending]  # finished: never run twice
        count = outcomes.hand_back(self.name, keep, self.using)
        # The count may hold jobs of a claim whose reply was lost (never counted claimed),
        # and lack known ones whose claim lapsed meanwhile (recovered elsewhere).
        handed = min(count, len(self.running))
        self.stats.handed_back += handed
        self.stats.unrecorded += len(self.running) - handed
        self.running.clear()
        self._claim_unsure = False
        log.warning("worker %s: handed %d unfinished job(s) back to the queue", self.name, count)
        return count
