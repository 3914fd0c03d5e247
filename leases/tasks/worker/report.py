"""What a worker says: one log line per written outcome (the job, its queue, attempt and
run time, and what happened), which keys hold jobs back, and its counts when it stops.
The lines carry the job's fields for `--log-format json`."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from leases.management.text import span

from ..jobs.outcomes import BOUNCE_DELAY, Outcome

log = logging.getLogger("leases.tasks.worker")

#: A --burst worker stays for retries of its own jobs due within this many seconds.
BURST_RETRY_WAIT = 60.0


@dataclass
class Stats:
    """What a worker did, counted once written: attempts claimed, and how they ended."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    recovered: int = 0
    bounced: int = 0
    claims: int = 0
    started: float = field(default_factory=time.monotonic)


def outcomes_written(worker: str, outcomes: list[Outcome], written: dict[int, str], stats: Stats,
                     grace: float) -> float:
    """Count and log outcomes once written; returns the moment (monotonic) a --burst
    worker should stay until for the retries due soon (0 for none)."""
    stay = 0.0
    for outcome in outcomes:
        job = outcome.job
        fields = {"job_id": job.id, "job_name": job.name, "queue": job.queue, "attempt": job.attempt,
                  "seconds": round(outcome.seconds, 6)}
        if outcome.ok:
            stats.succeeded += 1
            log.info("job %s #%d on %s succeeded in %s (attempt %d/%d)", job.name, job.id, job.queue,
                     span(outcome.seconds), job.attempt, job.max_attempts, extra={**fields, "outcome": "succeeded"})
            continue
        what = written.get(job.id, "")
        if what == "bounced":
            stats.bounced += 1
            log.warning("worker %s: no handler here for %s #%d (%s); back to the queue in %gs for a worker"
                        " that has it (it fails after %gs without one)", worker, job.name, job.id,
                        outcome.error[1], BOUNCE_DELAY, grace, extra={**fields, "outcome": "bounced"})
            continue
        stats.failed += 1
        if what == "retry" and outcome.delay <= BURST_RETRY_WAIT:
            stay = max(stay, time.monotonic() + outcome.delay + 1.0)
        _failure(outcome, what, grace, fields)
    return stay


def _failure(outcome: Outcome, what: str, grace: float, fields: dict) -> None:
    job = outcome.job
    error = f"{outcome.error[0]}: {outcome.error[1]}"
    took = span(outcome.seconds)
    if what == "retry":
        log.warning("job %s #%d on %s failed in %s (attempt %d/%d), retry in %.1fs: %s", job.name, job.id,
                    job.queue, took, job.attempt, job.max_attempts, outcome.delay, error,
                    extra={**fields, "outcome": "retry", "retry_in": round(outcome.delay, 3)})
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
    log.info("worker %s stopped: %d claimed, %d succeeded, %d failed, %d recovered, %d bounced", worker,
             stats.claimed, stats.succeeded, stats.failed, stats.recovered, stats.bounced)
