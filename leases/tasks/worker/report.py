"""What a worker says: one log line per written outcome (the job, its queue, attempt and
run time, and what happened), which keys hold jobs back, which handlers' queues it does
not serve, and its counts when it stops. The lines carry the job's fields for
`--log-format json`.

The stop line puts every attempt the worker claimed in exactly one bucket, so they add
up to "claimed": "12 claimed: 3 succeeded, 2 retried, 2 failed for good, 1 cancelled, 1
banned, 1 bounced, 1 suspended, 1 handed back". "Failed for good" is what `manage.py
jobs stats` counts as failed and dead."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from leases import db
from leases.management.text import span

from ..jobs.outcomes import BOUNCE_DELAY, Outcome
from ..registry import Handler

log = logging.getLogger("leases.tasks.worker")

#: A --burst worker stays for retries of its own jobs due within this many seconds.
BURST_RETRY_WAIT = 60.0
#: Names a line lists at most.
NAMES_SHOWN = 10
#: What became of a failed attempt, by what write_outcomes wrote: its job ended for good
#: (out of attempts, not to be retried, no worker had its handler).
ENDED = ("dead", "failed", "unhandled")
#: The stop line's buckets after "succeeded", in its order: (Stats field, words). Each
#: attempt claimed is counted in one of them once its end is known.
BUCKETS = (
    ("retried", "retried"),  # failed an attempt, runs again
    ("ended", "failed for good"),  # out of attempts, not to be retried, or no worker had its handler
    ("cancelled", "cancelled"),  # an operator cancelled it while it ran
    ("banned", "banned"),  # its target refused its resource: back to the queue for another
    ("bounced", "bounced"),  # no handler here: back to the queue for a worker that has it
    ("suspended", "suspended"),  # a durable sleep or wait: the job waits, holding no thread
    ("handed_back", "handed back"),  # still running when the stop's grace ran out: ready again, no try used
    ("unrecorded", "not recorded"),  # its claim had lapsed and was taken back: another attempt counts it
    ("lapsed", "left to lapse"),  # the database was away as the worker left: recovered once its lease lapses
)


@dataclass
class Stats:
    """What a worker did: attempts claimed, and each one's end once written, in one of
    the buckets of BUCKETS (or `succeeded`); `recovered` counts other workers' jobs it
    put back. `failed` is the attempts that failed (retried or failed for good)."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    ended: int = 0
    cancelled: int = 0
    banned: int = 0
    bounced: int = 0
    suspended: int = 0
    handed_back: int = 0
    unrecorded: int = 0
    lapsed: int = 0
    recovered: int = 0
    claims: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def failed(self) -> int:
        return self.retried + self.ended

    def counted(self) -> int:
        """Attempts whose end is counted: `claimed` once the worker has stopped."""
        return self.succeeded + sum(getattr(self, name) for name, _ in BUCKETS)


def outcomes_written(worker: str, outcomes: list[Outcome], written: dict[int, str], stats: Stats,
                     grace: float) -> float:
    """Count and log outcomes once written; returns the moment (monotonic) a --burst
    worker should stay until for the retries and durable sleeps due soon (0 for none)."""
    stay = 0.0
    said = log.isEnabledFor(logging.INFO)  # a line per success is most of this loop's cost
    for outcome in outcomes:
        if outcome.ok and not said:
            stats.succeeded += 1
            continue
        job = outcome.job
        fields = {"job_id": job.id, "job_name": job.name, "queue": job.queue, "attempt": job.attempt,
                  "seconds": round(outcome.seconds, 6)}
        if outcome.ok:
            stats.succeeded += 1
            log.info("job %s #%d on %s succeeded in %s (attempt %d/%d)", job.name, job.id, job.queue,
                     span(outcome.seconds), job.attempt, job.max_attempts, extra={**fields, "outcome": "succeeded"})
            continue
        what = written.get(job.id, "")
        if what in ("bounced", "handed"):
            stats.bounced += 1
            _bounced(worker, outcome, what, grace, fields)
            continue
        if what == "suspended":
            stats.suspended += 1
            pause = outcome.suspend
            waits = f"waits for the event {pause.event!r} until" if pause.event else "sleeps until"
            log.info("job %s #%d on %s %s %s, holding no thread", job.name, job.id, job.queue, waits,
                     f"{pause.until:%Y-%m-%d %H:%M:%S}Z", extra={**fields, "outcome": "suspended"})
            if pause.seconds is not None and pause.seconds <= BURST_RETRY_WAIT:
                stay = max(stay, time.monotonic() + pause.seconds + 1.0)
            continue
        if what == "banned":
            stats.banned += 1
            lease = job.lease
            log.warning("job %s #%d on %s: %s/%s banned for target %r (%s); back to the queue, for another"
                        " resource", job.name, job.id, job.queue, lease.pool, lease.name, job.target,
                        outcome.banned.reason or "no reason given", extra={**fields, "outcome": "banned"})
            continue
        if what == "cancelled":
            stats.cancelled += 1
        elif what == "retry":
            stats.retried += 1
        elif what in ENDED:
            stats.ended += 1
        else:  # "": its claim had been taken from it (fenced out)
            stats.unrecorded += 1
        if what == "retry" and outcome.delay <= BURST_RETRY_WAIT:
            stay = max(stay, time.monotonic() + outcome.delay + 1.0)
        _failure(outcome, what, grace, fields)
    return stay


def _bounced(worker: str, outcome: Outcome, what: str, grace: float, fields: dict) -> None:
    """A job whose handler this worker lacks, given back: to a worker that has it, or for
    later, with the fix named."""
    job = outcome.job
    if what == "handed":
        log.info("worker %s: no handler here for %s #%d; a worker that has it takes it (this one leaves %s"
                 " jobs to others for %gs; --import the module that defines it to run them here too)", worker,
                 job.name, job.id, job.name, BOUNCE_DELAY, extra={**fields, "outcome": "handed"})
        return
    log.warning("worker %s: no handler here for %s #%d (%s), and no live worker serving %s has it: start one"
                " with --import the module that defines it (or define it in an installed app's handlers.py);"
                " back to the queue in %gs, taken at once by a worker that starts with it, failed if none has it"
                " within %gs (LEASES_HANDLER_GRACE)", worker, job.name, job.id, outcome.error[1], job.queue,
                BOUNCE_DELAY, grace, extra={**fields, "outcome": "bounced"})


def pool_waiting(worker: str, wait: Any) -> None:
    """Jobs of a pool and target wait for a resource none of whose slots could start
    them, and why (one line each, now and then)."""
    log.info("worker %s: %d job(s) of pool %s wait for a resource: %s", worker, wait.due, wait.pool, wait.reason)


def took_over(worker: str, count: int) -> None:
    """The line of a worker that starts with the handler of jobs others handed back."""
    if count:
        log.info("worker %s: took over %d job(s) that workers without their handler handed back", worker, count)


def _failure(outcome: Outcome, what: str, grace: float, fields: dict) -> None:
    job = outcome.job
    # A suspension carries no error: its write came back "" when the reply to the COMMIT
    # that wrote it was lost (the rerun found the claim ended), and nothing is said of it.
    error = f"{outcome.error[0]}: {outcome.error[1]}" if outcome.error is not None else ""
    took = span(outcome.seconds)
    if what == "retry":
        log.warning("job %s #%d on %s failed in %s (attempt %d/%d), retry in %.1fs: %s", job.name, job.id,
                    job.queue, took, job.attempt, job.max_attempts, outcome.delay, error,
                    extra={**fields, "outcome": "retry", "retry_in": round(outcome.delay, 3)})
    elif what == "cancelled":
        log.warning("job %s #%d on %s cancelled while it ran (attempt %d/%d): %s", job.name, job.id, job.queue,
                    job.attempt, job.max_attempts, error, extra={**fields, "outcome": "cancelled"})
    elif what == "unhandled":
        log.error("job %s #%d on %s failed, not retried: no worker had its handler for %gs", job.name, job.id,
                  job.queue, grace, extra={**fields, "outcome": "failed"})
    elif what:
        # "dead": out of attempts; "failed": not to be retried (Fail, BadResult)
        words = "dead: out of attempts" if what == "dead" else "not retried"
        log.error("job %s #%d on %s failed in %s (attempt %d/%d), %s: %s", job.name, job.id, job.queue,
                  took, job.attempt, job.max_attempts, words, error, extra={**fields, "outcome": what})


def keys_at_limit(worker: str, blocked: dict[str, int]) -> None:
    """Which keys hold jobs back, and how many (the busiest ten)."""
    busiest = sorted(blocked.items(), key=lambda item: -item[1])[:10]
    log.info("worker %s: keys at their concurrency limit (jobs waiting): %s", worker,
             ", ".join(f"{key} ({count})" for key, count in busiest))


def stopped(worker: str, stats: Stats) -> None:
    """Attempts claimed and how each ended (the buckets add up to the claims); jobs of
    stopped workers it put back. A bucket nothing fell in is left out, but succeeded."""
    ends = [f"{stats.succeeded} succeeded"] + [
        f"{getattr(stats, name)} {words}" for name, words in BUCKETS if getattr(stats, name)]
    log.info("worker %s stopped: %d claimed: %s; %d jobs of stopped workers recovered", worker, stats.claimed,
             ", ".join(ends), stats.recovered)


def left_unreleased(worker: str, ttl: float, leading: bool, left: int, exc: BaseException) -> None:
    """A worker that leaves while its database does not answer: why it could not give
    its row back, and that the row frees itself, as what else it held does (one line,
    no traceback)."""
    also = (["the scheduler's lead"] if leading else []) + (
        [f"its {left} unfinished job(s) (other workers then recover them)"] if left else [])
    log.warning("worker %s could not release its row: the database does not answer (%s); the row frees itself"
                " within its ttl of %gs%s", worker, db.one_line(exc), ttl, ", as do " + " and ".join(also) if also
                else "")


def unserved(worker: str, queues: list[str], handlers: list[Handler]) -> None:
    """One warning at start: handlers whose jobs go to queues this worker does not serve,
    so a plain worker that never runs a handler of queue "crawl" says so."""
    missing = sorted({spec.queue for spec in handlers})
    named = ", ".join(f"{spec.name} ({spec.queue})" for spec in handlers[:NAMES_SHOWN])
    more = f" and {len(handlers) - NAMES_SHOWN} more" if len(handlers) > NAMES_SHOWN else ""
    log.warning("worker %s serves queues %s, not those of handlers %s%s: their jobs wait for another worker;"
                " to serve them too, --queue %s or --queue '*'", worker, ",".join(queues), named, more,
                ",".join(sorted({*queues, *missing})))


def due_elsewhere(worker: str, queues: list[str], due: dict[str, int]) -> None:
    """The line of a --burst worker that claimed nothing while jobs are due on queues it
    does not serve, before it exits."""
    busiest = sorted(due.items(), key=lambda item: (-item[1], item[0]))
    listed = ", ".join(f"{name} ({count})" for name, count in busiest[:NAMES_SHOWN])
    more = f" and {len(busiest) - NAMES_SHOWN} more" if len(busiest) > NAMES_SHOWN else ""
    log.warning("worker %s claimed nothing, but queues it does not serve have jobs due: %s%s; serve them"
                " with --queue %s or --queue '*'", worker, listed, more, ",".join(sorted({*queues, *due})))
