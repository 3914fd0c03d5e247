"""Errors raised by the lease engine."""


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
