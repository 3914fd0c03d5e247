"""What a worker's loop does on timers besides claiming and writing outcomes, each a
`Duty`: its heartbeat (its row's lease and its jobs'), recovery of other workers' lapsed
jobs, trims of finished runs, and, if it leads, the scheduler's passes.

`TimedDuties` is the part of `loop.JobWorker` that does them: the loop only runs each
when it is due, so this reads apart from claims and outcomes."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from leases.exceptions import LeaseLost

from ..jobs import history, leasing, limits, recovery, steps, waits
from ..schedules.leader import Scheduler
from . import report

log = logging.getLogger("leases.tasks.worker")

#: Seconds between recoveries of lapsed jobs (the ttl bounds how stale they can be).
RECOVER_EVERY = 5.0
#: Seconds between trims of keys' old runs.
TRIM_EVERY = 10.0
#: Seconds between two log lines naming the keys held at their limit, and between two
#: looks for jobs that wait for a resource none of whose slots could start them.
LIMIT_LOG_EVERY = 30.0


@dataclass
class Duty:
    """Something the loop does every `every` seconds, due first at `due`."""

    call: Callable[[], object]
    every: float
    due: float = 0.0
    #: Whether it goes on while the worker stops (the heartbeat must; claiming more must not).
    while_stopping: bool = True
    #: Whether the call returns the seconds until it is due again (it keeps its own pace).
    paced: bool = False

    def run_if_due(self, now: float, stopping: bool) -> None:
        if self.applies(stopping) and now >= self.due:
            after = self.call()
            # Not moved when the call raised: tried again next turn.
            self.due = now + (after if self.paced else self.every)

    def applies(self, stopping: bool) -> bool:
        return self.while_stopping or not stopping


class TimedDuties:
    """The worker's duties on timers; `JobWorker` holds the state they use (its row's
    hold, the jobs it runs, the outcomes it has not written, the keys that just ran)."""

    def _duties(self) -> list[Duty]:
        """What the loop does on timers, besides claiming and writing outcomes."""
        now = time.monotonic()
        duties = [
            Duty(self.heartbeat, self.ttl / 3, due=now + self.ttl / 3),
            Duty(self.recover, min(RECOVER_EVERY, self.ttl / 2), while_stopping=False),
            Duty(self.trim, TRIM_EVERY, due=now + TRIM_EVERY),
        ]
        if self.schedule:
            self.scheduler = Scheduler(self.name, self.ttl, self.using)
            duties.append(Duty(self.scheduler.step, 0.0, while_stopping=False, paced=True))
        return duties

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
        recovery.extend(self.name, self._ours(), self.ttl, self.using)
        leasing.renew([job.lease for job in self.running.values() if job.lease is not None], self.ttl, self.using)
        for job_id in steps.cancel_requested(self.name, [i for i, j in self.running.items() if not j.cancel_requested],
                                             self.using):
            job = self.running[job_id]
            job.cancel_requested, job.cancel_seen_at = True, time.monotonic()
            if job.context is not None:
                job.context.cancel_requested = True
            log.warning("worker %s: job %s #%d was cancelled while it runs: it stops at its next step, sleep or"
                        " wait, or is abandoned in %gs", self.name, job.name, job.id, self.grace)

    def _adopt(self, old: str) -> None:
        """Running jobs still under the lapsed name were not recovered: keep them as ours."""
        recovery.adopt(self.name, old, self.using)
        for job in self.running.values():
            job.worker = self.name
        for outcome in self._pending:
            outcome.job.worker = self.name

    def recover(self) -> int:
        """Put back the jobs of workers whose heartbeat lapsed: ready, or dead when out of
        attempts. Any live worker does this; SKIP LOCKED keeps them from colliding. This
        worker's own jobs are left alone when it still runs them (its heartbeat was late)."""
        total = recovery.recover_lapsed(self.using, by=f"worker {self.name}", keep=set(self._ours()),
                                        worker=self.name)
        self.stats.recovered += total
        blocked = limits.unblock_pass(self.using)
        now = time.monotonic()
        if blocked and now >= self._next_limit_log:
            self._next_limit_log = now + LIMIT_LOG_EVERY
            report.keys_at_limit(self.name, blocked)
        if self.pools and now >= self._next_wait_look:
            # A grouped read of every due job of its pools, then how the largest groups'
            # pools stand: once a period, not at every recovery, stuck or not.
            self._next_wait_look = now + LIMIT_LOG_EVERY
            for wait in waits.waiting(self.using, every=False, pools=self.pools):
                report.pool_waiting(self.name, wait)
        return total

    def trim(self) -> None:
        """Keep only the newest LEASES_KEEP_RUNS finished runs of the keys that just ran."""
        keys, self._finished_keys = self._finished_keys, set()
        if keys:
            history.trim_runs(keys, using=self.using)

