"""What a handler may take besides its payload: its job, its attempt, its lease (a handler
that needs a resource), and the durable calls: steps, sleeps, waits for events, and
whether the job was cancelled while it runs.

A handler asks for it by a parameter named `ctx` (``def fetch(payload, ctx)``); handlers
without one are called as before, and any code an attempt runs (a Django task's function)
reaches it through `current()`. The worker builds one per attempt.

A durable handler runs again from the top after a crash, a retry, a hand-back, a sleep or
a wait: each `ctx.step`, `sleep`, `wait_for` and `patched` takes the next place (from 1),
and a place whose step is stored returns what it stored instead of running again. So a
handler must call them in the same order each time; a stored step of another name at a
place fails the job (`StepMismatch`) unless the change is declared with `ctx.patched`.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

from leases.exceptions import Banned, Cancelled, StepMismatch, Suspend, TimedOut
from leases.validation import MAX_SECONDS, check_moment, check_name, check_seconds

from .joblease import JobLease
from .jobs import steps

_MISSING = object()


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
    #: The database the job lives on, and what fences its steps (the job's claim).
    using: str = field(default="", repr=False)
    claims: int = field(default=0, repr=False)
    #: Set by the worker when an operator cancelled the job while it runs.
    cancel_requested: bool = field(default=False, repr=False)
    _stored: dict[int, Any] | None = field(default=None, repr=False)
    _seq: int = field(default=0, repr=False)

    @property
    def id(self) -> int:
        return self.job_id

    @property
    def cancelled(self) -> bool:
        """Whether an operator cancelled the job while it runs (a long handler checks it
        now and then; steps, sleeps and waits raise `Cancelled`)."""
        return self.cancel_requested

    # -- durable calls ------------------------------------------------------------------

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` once for this job and return its JSON result: stored
        under the step's place, it is returned as stored when the handler runs again."""
        seq, stored = self._place(name)
        if stored is not None:
            return stored.result
        return steps.record(self, seq, name, fn(*args, **kwargs), self.using)

    def sleep(self, seconds: float) -> None:
        """Give the worker's slot back for `seconds` (by the database clock); the job waits
        in the database, holding no thread, and runs again from the top, its steps done."""
        self._suspend_until("sleep", seconds=check_seconds(seconds, "sleep seconds", maximum=MAX_SECONDS))

    def sleep_until(self, when: datetime) -> None:
        """`sleep` until the moment `when` (aware)."""
        self._suspend_until("sleep", at=check_moment(when, "sleep_until"))

    def wait_for(self, event: str, timeout: float | None = None, default: Any = _MISSING) -> Any:
        """The data of the event `event` sent to this job (`send_event`): at once if one was
        sent and no wait took it yet, else the job waits for it in the database, holding no
        thread. After `timeout` seconds without one: `TimedOut`, or `default` if given."""
        event = steps.check_event_name(event)
        if timeout is not None:
            timeout = check_seconds(timeout, "wait timeout", maximum=MAX_SECONDS)
        seq, stored = self._place(f"wait:{event}", finished=False)
        if stored is not None and stored.done:
            return self._waited(stored.result, event, default)
        found, data = steps.take_event(self, seq, event, self.using)
        if found:
            return data
        if stored is not None and stored.over:
            steps.time_out(self, seq, self.using)
            return self._waited({"timed_out": True}, event, default)
        until = stored.until if stored is not None else steps.begin(
            self, seq, f"wait:{event}", self.using, seconds=steps.FOREVER if timeout is None else timeout)
        raise Suspend(until, event)

    def patched(self, change: str) -> bool:
        """Whether this run takes the new code path of `change`: True for a job that met
        it first under the new code, False for one whose stored steps came from the old
        (it goes on the old path, so sleeping jobs survive a deploy)."""
        self._check_cancelled()
        marker = f"patch:{check_name(change, 'patch name', steps.PATCH_NAME_LENGTH)}"
        stored = self._steps().get(self._seq + 1)
        if stored is not None and stored.name != marker:
            return False  # an old run: no marker was stored here, and its place stays the step's
        self._seq += 1
        if stored is None:
            steps.record(self, self._seq, marker, True, self.using)
        return True

    # -- their awaitable forms, for async handlers: the database is written off the loop --

    async def astep(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`step` in an async handler: a coroutine function is awaited, a plain one runs
        on a thread of the worker's loop, so it may block."""
        seq, stored = await asyncio.to_thread(self._place, name)
        if stored is not None:
            return stored.result
        if inspect.iscoroutinefunction(fn):
            value = await fn(*args, **kwargs)
        else:
            value = await asyncio.to_thread(fn, *args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        return await asyncio.to_thread(steps.record, self, seq, name, value, self.using)

    async def asleep(self, seconds: float) -> None:
        """`sleep` in an async handler."""
        await asyncio.to_thread(self.sleep, seconds)

    async def asleep_until(self, when: datetime) -> None:
        """`sleep_until` in an async handler."""
        await asyncio.to_thread(self.sleep_until, when)

    async def await_for(self, event: str, timeout: float | None = None, default: Any = _MISSING) -> Any:
        """`wait_for` in an async handler."""
        return await asyncio.to_thread(self.wait_for, event, timeout, default)

    async def apatched(self, change: str) -> bool:
        """`patched` in an async handler."""
        return await asyncio.to_thread(self.patched, change)

    def _place(self, name: str, finished: bool = True) -> tuple[int, Any]:
        """The next place, and its stored step (None if none, or begun and not `finished`
        when only a finished one counts)."""
        self._check_cancelled()
        name = steps.check_step_name(name)
        self._seq += 1
        stored = self._steps().get(self._seq)
        if stored is not None and stored.name != name:
            raise StepMismatch(f"step {self._seq} was {stored.name!r}, now {name!r}: the handler changed under"
                               " a stored run; declare the change with ctx.patched(...)")
        if stored is not None and finished and not stored.done:
            return self._seq, None
        return self._seq, stored

    def _suspend_until(self, name: str, seconds: float | None = None, at: datetime | None = None) -> None:
        seq, stored = self._place(name, finished=False)
        if stored is not None and (stored.done or stored.over):
            return  # slept: go on
        if stored is not None:
            raise Suspend(stored.until)
        raise Suspend(steps.begin(self, seq, name, self.using, seconds, at), seconds=seconds)

    def _steps(self) -> dict[int, Any]:
        if self._stored is None:
            self._stored = steps.load(self.job_id, self.using)
        return self._stored

    def _check_cancelled(self) -> None:
        if self.cancel_requested:
            raise Cancelled(f"job #{self.job_id} was cancelled while it ran")

    @staticmethod
    def _waited(result: Any, event: str, default: Any) -> Any:
        if isinstance(result, dict) and result.get("timed_out"):
            if default is not _MISSING:
                return default
            raise TimedOut(f"no event {event!r} came before the wait's timeout")
        return result["data"]

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


def context_for(job: Any, using: str) -> JobContext:
    """The context of a claimed job's attempt, on the database `using`."""
    return JobContext(job_id=job.id, name=job.name, queue=job.queue, attempt=job.attempt,
                      max_attempts=job.max_attempts, target=job.target, lease=job.lease, using=using,
                      claims=job.claims, cancel_requested=job.cancel_requested)


_running: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("leases_job_context", default=None)


def current() -> JobContext | None:
    """The context of the attempt this thread (or asyncio task) runs, or None outside one."""
    return _running.get()


@contextmanager
def running(context: JobContext) -> Iterator[JobContext]:
    """Make `context` the one `current()` returns while the attempt runs."""
    token = _running.set(context)
    try:
        yield context
    finally:
        _running.reset(token)
