"""Errors raised by the lease engine."""
from __future__ import annotations

from typing import Any


class LeaseError(Exception):
    """Base class of every django-leases error."""


class LeaseLost(LeaseError):
    """The lease expired or passed to another holder; the resource is no longer yours."""


class NoResourceAvailable(LeaseError):
    """Every resource of the pool stayed held or quarantined for as long as we waited."""


class UnknownPool(LeaseError, LookupError):
    """The pool has no resources at all, so waiting for one would never end."""


class UnknownResource(LeaseError, LookupError):
    """No resource of that name in that pool."""


class Locked(LeaseError):
    """The lock is held by someone else (and stayed held for as long as we waited):
    `name`, and as last seen its `holder` and the seconds it had left, `expires_in`."""

    def __init__(self, message: str, name: str = "", holder: str = "", expires_in: float | None = None) -> None:
        super().__init__(message)
        self.name, self.holder, self.expires_in = name, holder, expires_in


class QueueFull(LeaseError):
    """The queue holds its `max_length` waiting jobs and its policy gave up on this push."""


class UnknownHandler(LeaseError, LookupError):
    """No handler is registered under that name (nor in any installed app's `handlers`)."""


class Fail(LeaseError):
    """Raised by a handler to fail its job now, without the retries it has left."""


class WorkerLost(LeaseError):
    """Recorded as the error of an attempt whose worker stopped heartbeating."""


class BadResult(LeaseError):
    """What a handler returned cannot be stored (not JSON, too large or too deep), or the
    database refused an attempt's outcome: the attempt fails with this, for good, since
    running the handler again would repeat its work."""


class Banned(LeaseError):
    """Raised by a handler whose target refused the resource its job holds ("banned
    here"): the job goes back to the queue without spending an attempt, and the resource
    is not used for that target for `seconds` (the handler's `ban_for` when None)."""

    def __init__(self, reason: str = "", seconds: float | None = None) -> None:
        super().__init__(reason or "banned")
        self.reason, self.seconds = reason, seconds


class Cancelled(LeaseError):
    """Raised in a durable handler (at its next step, sleep or wait) whose job an operator
    cancelled while it ran: the job ends cancelled. Checking `ctx.cancelled` stops earlier."""


class TimedOut(LeaseError):
    """A durable handler's wait (`ctx.wait_for`) reached its timeout without its event."""


class StepMismatch(Fail):
    """A durable job met a stored step of another name at the same place: the handler's
    code changed under it. It fails for good, unless the change is declared with
    `ctx.patched(...)`."""


class Suspend(BaseException):  # noqa: N818 - a control flow, not an error
    """Raised by a durable handler's sleep or wait to give its worker slot back: the job
    waits in the database until `until` (or, with `event`, that event). A BaseException,
    so a handler's `except Exception` does not swallow it. `seconds`, when known, is how
    long a sleep begun now lasts (a --burst worker stays for a short one, as for a retry)."""

    def __init__(self, until: Any, event: str = "", seconds: float | None = None) -> None:
        super().__init__(f"suspended until {until}" + (f" or the event {event!r}" if event else ""))
        self.until, self.event, self.seconds = until, event, seconds


class JobFailed(LeaseError):
    """What a wait on a job's result (`leases.tasks.wait`, `Job.wait`) raises when the job
    ended without succeeding: failed, dead or cancelled (`status`), or was deleted."""

    def __init__(self, message: str, status: str = "") -> None:
        super().__init__(message)
        self.status = status
