"""Handlers: the functions jobs are routed to by name (the seed's strategy pattern).

A handler is registered with `@handler(name, ...)` in an installed app's ``handlers``
module (imported on first need, by pushers and workers alike) or in a module the worker
is told to import. Its options are the job's defaults: queue, attempts, backoff, timeout.
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

from django.utils.module_loading import autodiscover_modules

from leases.exceptions import UnknownHandler
from leases.validation import check_name, check_seconds

from . import limits
from .models import JOB_NAME_LENGTH, QUEUE_LENGTH

#: Longest pause between two attempts, whatever the backoff says.
MAX_BACKOFF = 86400.0
#: Base of the exponential backoff when a handler names none.
DEFAULT_BACKOFF = 10.0

log = logging.getLogger("leases.tasks")

Backoff = float | Callable[[int], float]


def check_queue(queue: Any) -> str:
    """A queue name: printable, and without commas (workers take comma-separated lists)."""
    check_name(queue, "queue", QUEUE_LENGTH)
    if "," in queue:
        raise ValueError(f"queue must be a name without commas, not {queue!r}")
    return queue


def check_attempts(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ValueError(f"max_attempts must be a whole number from 1 to 1000, not {value!r}")
    return value


def check_backoff(value: Any) -> Backoff:
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"backoff must be seconds >= 0 or a callable(attempt), not {value!r}")
    return float(value)


def check_timeout(value: Any) -> float | None:
    return None if value is None else check_seconds(value, "timeout", above=True)


def retry_delay(backoff: Backoff, attempt: int) -> float:
    """Seconds before the attempt after failed attempt number `attempt` (1 for the first).

    A number is the base of an exponential backoff with "equal jitter": between half and
    all of base * 2**(attempt-1), so retries of jobs that failed together spread out.
    """
    if callable(backoff):
        try:
            delay = float(backoff(attempt))
        except Exception:  # noqa: BLE001 - a broken backoff must not cost the job its retry
            log.exception("backoff %r failed for attempt %d; using the default", backoff, attempt)
            return retry_delay(DEFAULT_BACKOFF, attempt)
        return min(max(delay, 0.0), MAX_BACKOFF) if math.isfinite(delay) else MAX_BACKOFF
    full = min(backoff * 2 ** min(attempt - 1, 60), MAX_BACKOFF)
    return full / 2 + random.uniform(0, full / 2)


@dataclass(frozen=True)
class Handler:
    """How jobs of one name run: `func(payload)` and the defaults of their jobs."""

    name: str
    func: Callable[..., Any]
    queue: str = "default"
    max_attempts: int = 3
    backoff: Backoff = DEFAULT_BACKOFF
    timeout: float | None = None
    #: The key its jobs' limits count by: a string, or a function of the payload.
    limit_key: str | Callable[[Any], str] | None = None
    concurrency: int | None = None
    rate: str = ""

    def run(self, job: Any) -> Any:
        """Run one claimed job (the worker's entry point; backend tasks override it)."""
        return self.func(job.payload)

    def delay(self, attempt: int) -> float:
        return retry_delay(self.backoff, attempt)


_HANDLERS: dict[str, Handler] = {}
_discovered = False


def handler(
    name: str,
    queue: str = "default",
    max_attempts: int = 3,
    backoff: Backoff = DEFAULT_BACKOFF,
    timeout: float | None = None,
    limit_key: str | Callable[[Any], str] | None = None,
    concurrency: int | None = None,
    rate: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the handler of jobs named `name`.

    It is called with the job's payload; what it returns (JSON) is kept as the result.
    It runs in a worker thread, so it may block; `timeout` fails an attempt that runs
    longer (the thread itself cannot be stopped: its late outcome is ignored).
    `limit_key` (a string, or a function of the payload) names the key its jobs count
    by: at most `concurrency` of a key run at once, and at most `rate` ("10/m") start
    per period, across every worker (see leases.tasks.limits).
    """
    check_name(name, "handler name", JOB_NAME_LENGTH)
    if limit_key is not None and not callable(limit_key):
        limits.check_limit_key(limit_key)
    spec = dict(
        queue=check_queue(queue),
        max_attempts=check_attempts(max_attempts),
        backoff=check_backoff(backoff),
        timeout=check_timeout(timeout),
        limit_key=limit_key,
        concurrency=limits.check_concurrency(concurrency),
        rate=limits.check_rate(rate),
    )

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        existing = _HANDLERS.get(name)
        if existing is not None and existing.func is not func and _qualname(existing.func) != _qualname(func):
            raise ValueError(f"handler {name!r} is already registered to {_qualname(existing.func)}")
        _HANDLERS[name] = Handler(name=name, func=func, **spec)
        return func

    return register


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def discover() -> None:
    """Import every installed app's ``handlers`` module (once per process)."""
    global _discovered
    if not _discovered:
        autodiscover_modules("handlers")
        _discovered = True


def get(name: str) -> Handler:
    """The handler registered as `name`; UnknownHandler if there is none."""
    found = _HANDLERS.get(name)
    if found is None:
        discover()
        found = _HANDLERS.get(name)
    if found is None:
        known = ", ".join(sorted(_HANDLERS)[:10]) or "none registered"
        raise UnknownHandler(f"no handler named {name!r} (known: {known})")
    return found


def find(name: str) -> Handler | None:
    """The handler registered as `name`, or None."""
    discover()
    return _HANDLERS.get(name)


_RUNNERS: dict[str, Callable[[Any], Any]] = {}


def add_runner(backend: str, factory: Callable[[Any], Any]) -> None:
    """Run jobs whose `backend` is `backend` with `factory(claimed job)`: an object with
    `run(job)`, `delay(attempt)` and `timeout`, as a Handler has (an app's ready())."""
    _RUNNERS[backend] = factory


def runner(backend: str) -> Callable[[Any], Any] | None:
    return _RUNNERS.get(backend)


_FINISHERS: dict[str, Callable[[Any, list[tuple[int, str]]], None]] = {}


def add_finisher(on_finish: str, finisher: Callable[[Any, list[tuple[int, str]]], None]) -> None:
    """Handle the endings of jobs whose `on_finish` is `on_finish` with
    `finisher(cursor, [(job id, queue), ...])`, called in the transaction that ends them,
    instead of queueing one follow-up job per ending (an app's ready()). It must only
    write through the cursor's connection and raise nothing but database errors: the
    outcomes it rides with are retried, or written one by one, when it raises."""
    _FINISHERS[on_finish] = finisher


def finisher(on_finish: str) -> Callable[[Any, list[tuple[int, str]]], None] | None:
    return _FINISHERS.get(on_finish)


def registered() -> dict[str, Handler]:
    discover()
    return dict(_HANDLERS)
