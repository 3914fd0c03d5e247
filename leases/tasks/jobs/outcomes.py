"""An attempt's end, written in one transaction per batch: succeeded, retried later with
its handler's backoff, failed or dead for good, given back (no handler here: see
`handoff`), or handed back by a worker that stops. Each statement names the claim it ends, so a late finisher
whose attempt was recovered and run again elsewhere writes nothing.

When a job ends for good, the same transaction queues its `on_finish` follow-up (or hands
the ending to the finisher an app registered) and frees its key's slot: an ending and
what it sets off commit together or not at all.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Any, Iterable

from leases import db, targets
from leases.exceptions import BadResult, Banned, Cancelled, Fail, Suspend
from leases.sql import in_list
from leases.validation import clean_text

from .. import registry, sql
from ..models import PRIORITY_RANGE, Job, JobError
from ..needs import BAN_FOR
from . import leasing, limits, results, steps
from .claim import ClaimedJob
from .payload import dump_payload
from .push import JobDefaults, announce, new_job, write

#: Seconds before a job this worker has no handler for may be claimed again.
BOUNCE_DELAY = 10.0
#: Attempts of an on_finish job whose handler this process does not know.
FOLLOW_UP_ATTEMPTS = 100
#: Bounds of what one failed attempt stores, in characters (the class path's column
#: holds 255); the middle of a longer text is cut, the end of a traceback kept.
CLASS_PATH_LIMIT = 255
MESSAGE_LIMIT = 10_000
TRACEBACK_LIMIT = 50_000


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
    #: No handler here: back to the queue for a worker that has one (no try used), at
    #: once when a live worker has it (`elsewhere`, see `handoff`), else after BOUNCE_DELAY.
    bounce: bool = False
    elsewhere: bool = False
    #: The target refused the job's resource (`Banned`): back to the queue without using a
    #: try, that resource banned for that target.
    banned: Banned | None = None
    #: A durable handler's sleep or wait: the job waits, ready, until its end or event.
    suspend: Suspend | None = None
    #: The handler stopped on an operator's cancel (`Cancelled`), or ignored it past the
    #: grace: the job ends cancelled.
    cancelled: bool = False
    #: Seconds the attempt ran (for the log).
    seconds: float = 0.0

    def refused(self, exc: BaseException) -> Outcome:
        """What to write instead when the database refused this outcome: a failure whose
        error says so (a result refused fails for good, as a handler's rerun repeats work)."""
        error = describe(BadResult(f"the database refused this attempt's outcome: {describe(exc)[1][:1000]}"))
        if self.ok:
            return replace(self, ok=False, error=error, retryable=False, bounce=False)
        return replace(self, error=error, bounce=False)


def failed(job: ClaimedJob, exc: BaseException, retryable: bool, delay: float = 0.0) -> Outcome:
    return Outcome(job, ok=False, error=describe(exc), retryable=retryable, delay=delay)


def raised(job: ClaimedJob, spec: Any, exc: BaseException) -> Outcome:
    """The outcome of an attempt whose handler raised `exc`."""
    if isinstance(exc, Suspend):  # a durable sleep or wait: the slot goes back, the job waits
        return Outcome(job, ok=False, suspend=exc)
    if isinstance(exc, Cancelled):
        return Outcome(job, ok=False, error=describe(exc), cancelled=True)
    if isinstance(exc, Banned):
        if job.lease is None:  # nothing to ban: an ordinary failure
            return failed(job, exc, retryable=True, delay=spec.delay(job.attempt))
        return Outcome(job, ok=False, error=describe(exc), banned=exc)
    if isinstance(exc, (Fail, BadResult)):
        return failed(job, exc, retryable=False)
    return failed(job, exc, retryable=True, delay=spec.delay(job.attempt))


def returned(job: ClaimedJob, value: Any) -> Outcome:
    """The outcome of an attempt whose handler returned `value` (JSON, or it failed)."""
    try:
        return Outcome(job, ok=True, result=dump_payload(value, "the handler's return value"))
    except ValueError as exc:
        return failed(job, BadResult(str(exc)), retryable=False)


def _pairs(count: int) -> str:
    return " OR ".join(["(id = %s AND claims = %s)"] * count) + ")"


def write_outcomes(outcomes: list[Outcome], worker: str, grace: float, using: str) -> dict[int, str]:
    """Write outcomes in one transaction; each only if its claim is still running.

    Returns what was written of each failure, by job id (see `Ending.written`). Resources
    the attempts held are released in the same transaction.
    """
    ending = Ending(outcomes, worker, grace, using)

    def work(cursor: Any, resumed: bool) -> None:
        with db.write_transaction(using):
            ending.write(cursor)

    db.run(work, using)
    return ending.written


class Ending:
    """A batch of outcomes, grouped once, written by `write` in the caller's transaction:
    `write_outcomes`' own, or a worker's next claim (`claim.claim`), which saves a
    transaction per batch when the batch is `simple`."""

    def __init__(self, outcomes: list[Outcome], worker: str, grace: float, using: str) -> None:
        self.outcomes, self.worker, self.grace, self.using = outcomes, worker, grace, using
        self.wins: dict[str, list[Outcome]] = {}
        #: Succeeded with an on_finish, by result: the attempts still running are locked
        #: first, so the follow-ups go to exactly the ones this write ends.
        self.followed: dict[str, list[Outcome]] = {}
        self.losses: list[Outcome] = []
        for outcome in outcomes:
            if outcome.ok and outcome.job.on_finish:
                self.followed.setdefault(outcome.result, []).append(outcome)
            elif outcome.ok:
                self.wins.setdefault(outcome.result, []).append(outcome)
            else:
                self.losses.append(outcome)
        #: What was written of each failure, by job id: "retry", "dead", "failed", "bounced"
        #: (back later), "handed" (back now, for a worker that has its handler), "banned"
        #: (back now, for another resource), "suspended" (a durable sleep or wait),
        #: "cancelled", "unhandled", or "" when its claim had been taken from it.
        self.written: dict[int, str] = {}

    @property
    def simple(self) -> bool:
        """Whether writing it locks only its own jobs' rows (no key, resource, follow-up or
        step): it may then share the next claim's transaction without taking locks in
        another order than a claim does."""
        return not self.followed and all(
            not o.job.limit_key and o.job.lease is None and o.suspend is None and o.banned is None
            and not o.cancelled and not o.bounce for o in self.outcomes)

    def write(self, cursor: Any) -> None:
        self.written.clear()
        st = sql.jobs(cursor.db)
        ended: list[tuple[int, str, str]] = []
        for result, group in self.wins.items():
            cursor.execute(st.succeed + _pairs(len(group)),
                           [result, *(value for o in group for value in (o.job.id, o.job.claims))])
        for result, group in self.followed.items():
            cursor.execute(st.still_running + _pairs(len(group)) + db.for_update(cursor.db),
                           [value for o in group for value in (o.job.id, o.job.claims)])
            running = {job_id for (job_id,) in cursor.fetchall()}
            group = [o for o in group if o.job.id in running]
            if group:
                cursor.execute(st.succeed + _pairs(len(group)),
                               [result, *(value for o in group for value in (o.job.id, o.job.claims))])
                ended.extend((o.job.id, o.job.queue, o.job.on_finish) for o in group)
        for outcome in self.losses:
            what = _write_failure(cursor, outcome, self.worker, self.grace)
            self.written[outcome.job.id] = what
            if what in ("dead", "failed", "unhandled", "cancelled"):
                ended.append((outcome.job.id, outcome.job.queue, outcome.job.on_finish))
        follow_ups(cursor, ended)
        limits.free_slots(cursor, [o.job.limits for o in self.outcomes if o.job.limit_key], self.using)
        _release(cursor, [o for o in self.outcomes if o.job.lease is not None])
        results.announce_ended(cursor, [o.job.id for o in self.outcomes if o.ok] + [i for i, _, _ in ended])
        # A freed slot or resource may let another worker's waiting job run now.
        announce(cursor, (o.job.queue for o in self.outcomes
                          if (o.job.limit_key and o.job.concurrency) or o.job.lease))


def _release(cursor: Any, ended: list[Outcome]) -> None:
    """Release the resources the ended attempts held, each only while its lease still
    holds it, a statement per cool-down: after its handler's cool-down, resting it for its
    target if the handler asked (`ctx.rest`), banned for its target if it refused it."""
    by_cooldown: dict[float, list[Any]] = {}
    for outcome in sorted(ended, key=lambda o: o.job.lease.id):
        job, lease = outcome.job, outcome.job.lease
        needs = leasing.needs_for(job.name, job.backend)
        if outcome.banned is not None:
            seconds = outcome.banned.seconds if outcome.banned.seconds is not None else (
                needs.ban_for if needs is not None else BAN_FOR)
            targets.verdict(cursor, "ban", lease.pool, lease.name, job.target, seconds, outcome.banned.reason,
                            holder=lease.holder, job=job.id)
        resting = getattr(job.context, "resting", None)
        if resting:
            targets.verdict(cursor, "rest", lease.pool, lease.name, job.target, resting, holder=lease.holder,
                            job=job.id)
        cooldown = needs.cooldown if needs is not None and outcome.banned is None else 0.0
        by_cooldown.setdefault(cooldown, []).append(lease)
    for cooldown, leases in sorted(by_cooldown.items()):
        leasing.release(cursor, leases, cooldown)


def _write_failure(cursor: Any, outcome: Outcome, worker: str, grace: float) -> str:
    """Write one failed attempt and its error; what became of it (see write_outcomes)."""
    st, seconds = sql.jobs(cursor.db), db.dialect(cursor.db).seconds
    job = outcome.job
    fence = (job.id, job.claims)
    if outcome.banned is not None:  # no try used; the next claim pairs it with another resource
        cursor.execute(st.give_back_banned, fence)
        return "banned" if cursor.rowcount == 1 else ""
    if outcome.suspend is not None:  # no try used either: it resumes after its last step
        return "suspended" if steps.suspend(cursor, job, outcome.suspend.until, outcome.suspend.event) else ""
    if outcome.cancelled:
        cursor.execute(sql.steps(cursor.db).end_cancelled, fence)
        if cursor.rowcount != 1:
            return ""
        cursor.execute(st.record_error, (job.id, job.attempt, *outcome.error, worker))
        return "cancelled"
    if outcome.bounce and outcome.elsewhere:
        cursor.execute(st.give_back_now, fence)
        return "handed" if cursor.rowcount == 1 else ""
    if outcome.bounce:
        cursor.execute(st.fail_unhandled, (*fence, seconds(-grace)))
        if cursor.rowcount != 1:
            cursor.execute(st.give_back_unhandled, (seconds(BOUNCE_DELAY), *fence))
            return "bounced" if cursor.rowcount == 1 else ""
        what = "unhandled"
    elif outcome.retryable and job.attempt < job.max_attempts:
        cursor.execute(st.retry_later, (seconds(outcome.delay), *fence))
        what = "retry"
    else:
        cursor.execute(st.end_unsuccessful, (Job.DEAD if outcome.retryable else Job.FAILED, *fence))
        what = "dead" if outcome.retryable else "failed"
    if cursor.rowcount != 1:  # a fenced-out attempt records nothing
        return ""
    cursor.execute(st.record_error, (job.id, job.attempt, *outcome.error, worker))
    return what


def hand_back(worker: str, keep: list[int], using: str) -> int:
    """Put every attempt still running under `worker` back to ready, without using up a
    try (the unfinished ones, and any whose claim reply was lost), but those of `keep`
    (finished, their outcomes not yet written: never run twice). Returns how many."""
    params: list = [worker, *keep]
    rest = " AND id NOT IN (" + in_list(keep) if keep else ""

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.jobs(cursor.db)
        with db.write_transaction(using):
            cursor.execute(st.hand_back_keys + rest, params)  # whose slots come free
            keys = cursor.fetchall()
            leasing.release_handed_back(cursor, worker, keep)
            cursor.execute(st.hand_back + rest, params)
            count = cursor.rowcount
            limits.free_slots(cursor, keys, using)
        return count

    return db.run(work, using)


def follow_ups(cursor: Any, ended: Iterable[tuple[int, str, str]]) -> None:
    """Queue the on_finish job of each (id, queue, on_finish) that just ended for good, in
    the caller's transaction, so the ending and its notice commit together: on the ended
    job's queue (which a worker serves), ahead of ordinary work, once per ending (its key
    merges a second one). Endings whose on_finish has a finisher go to it, a batch at a time."""
    batches: dict[str, list[tuple[int, str]]] = {}
    jobs = []
    for job_id, queue, on_finish in ended:
        if not on_finish:
            continue
        if registry.finisher(on_finish) is not None:
            batches.setdefault(on_finish, []).append((job_id, queue))
            continue
        jobs.append(new_job(on_finish, {"job": job_id}, queue=queue, key=f"{on_finish}:{job_id}",
                            priority=PRIORITY_RANGE[1], settings=registry.find(on_finish) or JobDefaults(queue, FOLLOW_UP_ATTEMPTS)))
    if jobs:
        write(cursor, jobs)
    for on_finish, batch in batches.items():
        registry.finisher(on_finish)(cursor, batch)


def last_errors(job_ids: Iterable[int], using: str) -> dict[int, str]:
    """{job id: "Exception: message"} of each job's newest failed attempt, as a run's or a
    task's error shows it."""
    errors = JobError.objects.using(using).filter(job_id__in=list(job_ids)).order_by("job_id", "-attempt", "-id")
    last: dict[int, str] = {}
    for job_id, exception, message in errors.values_list("job_id", "exception", "message"):
        last.setdefault(job_id, f"{exception.rsplit('.', 1)[-1]}: {message}"[:10000])
    return last
