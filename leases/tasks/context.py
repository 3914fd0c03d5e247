"""What a handler may take besides its payload: its job, its attempt and, for a handler
that needs a resource, its lease.

A handler asks for it by a parameter named `ctx` (``def fetch(payload, ctx)``); handlers
without one are called as before, and any code an attempt runs (a Django task's function)
reaches it through `current()`. The worker builds one per attempt. It is the one context
later features extend (steps, sleeps, waits, cancellation).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from leases.exceptions import Banned, LeaseLost
from leases.validation import check_seconds


@dataclass
class JobLease:
    """The resource a running job holds: claimed with the job, renewed by its worker's
    heartbeat, released when the attempt ends. `token` is the fencing token: it grows with
    every acquisition of the resource, so a system that remembers the highest it has seen
    can refuse a stale holder."""

    pool: str
    name: str
    slot: int
    data: Any
    token: int
    id: int
    holder: str
    #: Set by the worker when a renewal failed (the resource was released, quarantined or
    #: removed by an operator): the job no longer holds it.
    lost: bool = False

    def check(self) -> None:
        """LeaseLost if the job no longer holds its resource."""
        if self.lost:
            raise LeaseLost(f"job's lease on {self.pool}/{self.name} (token {self.token}) was lost")


@dataclass
class JobContext:
    """One attempt of one job, as its handler sees it."""

    job_id: int
    name: str
    queue: str
    attempt: int
    max_attempts: int
    #: The job's target ("" for none): bans, rests and pace count per target.
    target: str = ""
    lease: JobLease | None = None
    #: Seconds the resource should rest for this target once released (`rest`).
    resting: float | None = field(default=None, repr=False)

    def ban(self, reason: str = "", seconds: float | None = None) -> NoReturn:
        """The target refused this resource ("banned here"): the job goes back to the
        queue without spending an attempt and runs next on another resource, and this one
        is not used for this target for `seconds` (the handler's `ban_for` by default),
        while other targets still use it."""
        raise Banned(reason, seconds)

    def rest(self, seconds: float) -> None:
        """Rest this resource for this target only, once the attempt ends (a cool-down, as
        a site's `Retry-After` asks)."""
        self.resting = check_seconds(seconds, "rest seconds")

    @property
    def lost(self) -> bool:
        """Whether the job lost its resource's lease while it ran."""
        return self.lease is not None and self.lease.lost


def context_for(job: Any) -> JobContext:
    """The context of a claimed job's attempt."""
    return JobContext(job_id=job.id, name=job.name, queue=job.queue, attempt=job.attempt,
                      max_attempts=job.max_attempts, target=job.target, lease=job.lease)


_running = threading.local()


def current() -> JobContext | None:
    """The context of the attempt this thread runs, or None outside one."""
    return getattr(_running, "context", None)


@contextmanager
def running(context: JobContext) -> Iterator[JobContext]:
    """Make `context` the one `current()` returns while the attempt runs."""
    _running.context = context
    try:
        yield context
    finally:
        _running.context = None
