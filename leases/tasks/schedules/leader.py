"""The scheduler inside every `leases_worker`: one worker at a time leads, through this
project's own lock, and fires due ticks (`fire.fire_some`).

Between passes the leader sleeps until the soonest tick by the database clock, at most
PASS_EVERY: a tick is fired as it falls due, not up to a pass later.

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

from .fire import fire_some, until_due

log = logging.getLogger("leases.tasks.scheduler")

#: The lock whose holder leads.
LOCK = "leases.scheduler"
#: Most seconds between two passes of the leader (and two tries to lead of the others):
#: a schedule made or changed meanwhile is seen within this.
PASS_EVERY = 0.5
#: Seconds before the next pass when a tick is due and a pass fired nothing: another
#: pass holds its row, and trying again at once would spin.
RETRY_AFTER = 0.05
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
                if fired:
                    self.fired += fired
                    log.info("scheduler: fired %d job(s)%s", fired, ", more due" if more else "")
                if more:
                    self._next = now  # more is due: go on at the loop's next turn
                else:
                    self._next = min(self._next, self._soonest(fired > 0))
        except Error as exc:
            log.error("scheduler: database error, trying again in %gs: %s", PASS_EVERY, exc)
        except Exception:  # noqa: BLE001 - a schedule the code cannot handle must not stop the worker
            log.exception("scheduler: a pass failed")
        return max(0.0, self._next - time.monotonic())

    def _soonest(self, fired: bool) -> float:
        """When (by time.monotonic()) the soonest tick falls due, by the database clock. One
        already due fell due during a pass that fired (go on), or another pass holds it."""
        wait = until_due(self.using)
        if wait is None:
            return float("inf")
        return time.monotonic() + (wait if wait > 0 else 0.0 if fired else RETRY_AFTER)

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
        """Give the lead up, so another worker takes it at once. A database error is
        raised for the worker to say, with what else lapses: the lead does within the ttl."""
        lead, self.lead = self.lead, None
        if lead is not None:
            lead.release()
