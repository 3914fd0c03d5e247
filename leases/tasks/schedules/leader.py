"""The scheduler inside every `leases_worker`: one worker at a time leads, through this
project's own lock, and fires due ticks (`fire.fire_some`).

The lead is a lease with the worker's ttl, renewed every ttl/3 from the worker's loop;
when its holder dies or hangs, another worker takes it within that ttl. A leader that
lost the lead without knowing (paused past its ttl) can still fire a pass, but the rows
it would fire are locked or already moved on, and a run's (schedule, tick) is unique.
"""
from __future__ import annotations

import logging
import time

from django.db import Error

from leases.exceptions import LeaseLost, Locked
from leases.locks import HeldLock, acquire_lock

from .fire import fire_some

log = logging.getLogger("leases.tasks.scheduler")

#: The lock whose holder leads.
LOCK = "leases.scheduler"
#: Seconds between two passes of the leader (and two tries to lead of the others).
PASS_EVERY = 0.5
#: Seconds a pass may fire for before the worker's loop gets its turn (heartbeats, outcomes).
STEP_BUDGET = 0.5


class Scheduler:
    """Leads when it can and fires due ticks; `step()` is called by the worker's loop."""

    def __init__(self, holder: str, ttl: float, using: str) -> None:
        self.holder, self.ttl, self.using = holder, ttl, using
        self.lead: HeldLock | None = None
        self._next = 0.0
        self.fired = 0

    def step(self) -> float:
        """A pass if one is due; the seconds until the next is (0: more ticks are due)."""
        now = time.monotonic()
        if now < self._next:
            return self._next - now
        self._next = now + PASS_EVERY
        try:
            if self._leading():
                fired, more = fire_some(using=self.using, budget=STEP_BUDGET)
                if more:
                    self._next = now  # more is due: go on at the loop's next turn
                if fired:
                    self.fired += fired
                    log.info("scheduler: fired %d job(s)%s", fired, ", more due" if more else "")
        except Error as exc:
            log.error("scheduler: database error, trying again in %gs: %s", PASS_EVERY, exc)
        except Exception:  # noqa: BLE001 - a schedule the code cannot handle must not stop the worker
            log.exception("scheduler: a pass failed")
        return max(0.0, self._next - time.monotonic())

    def _leading(self) -> bool:
        """Whether this worker leads now: renew the lead when a third of it has gone, or
        take it when it is free."""
        if self.lead is not None:
            if self.lead.remaining() > self.ttl * 2 / 3:
                return True
            try:
                self.lead.extend(self.ttl)
                return True
            except LeaseLost:
                log.warning("scheduler: worker %s lost the lead", self.holder)
                self.lead = None
        try:
            self.lead = acquire_lock(LOCK, ttl=self.ttl, holder=self.holder, using=self.using)
        except Locked:
            return False
        log.info("scheduler: worker %s leads (lock %s, token %d)", self.holder, LOCK, self.lead.token)
        return True

    def stop(self) -> None:
        """Give the lead up, so another worker takes it at once."""
        if self.lead is not None:
            try:
                self.lead.release()
            except Exception:  # noqa: BLE001 - it lapses within the ttl anyway
                log.warning("scheduler: could not give the lead up; it lapses within %gs", self.ttl)
            self.lead = None
