"""What a job's name stands for: its handler (a strategy per name), and what apps
register beside handlers.

A handler is registered with `@handler(name, ...)` in an installed app's ``handlers``
module (imported on first need, by pushers and workers alike) or in a module the worker
is told to import. Its options are its jobs' settings, applied by the one maker of job
rows (`leases.tasks.jobs.push`) whoever enqueues: queue, attempts, backoff, timeout and
per-key limits. Above a Django task, `@handler(...)` sets that task's limits.

Apps extend the queue here, in their `ready()`: a runner runs the jobs of a `backend`
(pipelines' tasks), a finisher hears, in the ending transaction, that jobs with its
`on_finish` ended, and a schedule target is something a schedule may start besides a
handler's job (a pipeline run).
"""
from __future__ import annotations

import inspect
import logging
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable

from django.utils.module_loading import autodiscover_modules

from leases.exceptions import UnknownHandler
from leases.validation import Backoff, check_attempts, check_backoff, check_name, check_queue, check_timeout

from .jobs import limits
from .models import JOB_NAME_LENGTH
from .needs import Needs, by_payload, needs_of

#: Longest pause between two attempts, whatever the backoff says.
MAX_BACKOFF = 86400.0
#: Base of the exponential backoff when a handler names none.
DEFAULT_BACKOFF = 10.0

log = logging.getLogger("leases.tasks")

#: A job's limit key: a string, or a function of the payload its handler receives.
LimitKey = str | Callable[[Any], str] | None


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
    """How jobs of one name run: `func(payload)`, and their settings."""

    name: str
    func: Callable[..., Any]
    queue: str = "default"
    max_attempts: int = 3
    backoff: Backoff = DEFAULT_BACKOFF
    timeout: float | None = None
    #: The key its jobs' limits count by: a string, or a function of the payload.
    limit_key: LimitKey = None
    concurrency: int | None = None
    rate: str = ""
    #: An app's bookkeeping (a pipeline's advance event), not an operator's work.
    internal: bool = False
    #: The resource its jobs hold while they run (see leases.tasks.needs).
    needs: Needs | None = None
    #: Whether it takes the attempt's context (a parameter named `ctx`).
    takes_context: bool = False
    #: An `async def` handler: the worker awaits it on its event loop.
    is_async: bool = False

    @property
    def keyed(self) -> bool:
        """Whether its jobs' keys are computed from what it receives (see needs.by_payload)."""
        return by_payload(self.limit_key, self.needs)

    def run(self, job: Any) -> Any:
        """Run one claimed job (the worker's entry point; other runners override it): its
        result, or for an async handler the coroutine the worker awaits."""
        if self.takes_context:
            return self.func(job.payload, ctx=job.context)
        return self.func(job.payload)

    def delay(self, attempt: int) -> float:
        return retry_delay(self.backoff, attempt)


@dataclass(frozen=True)
class TaskLimits:
    """The limits of a Django task's jobs, set by `@handler(...)` above `@task()`: its key
    (a string, or a function of the payload {"args": [...], "kwargs": {...}}), how many of
    the key run at once, how many start per period."""

    limit_key: LimitKey = None
    concurrency: int | None = None
    rate: str = ""
    #: The resource each of its jobs holds while it runs (see leases.tasks.needs).
    needs: Needs | None = None


_HANDLERS: dict[str, Handler] = {}
_TASKS: dict[str, TaskLimits] = {}
_discovered = False


def handler(
    name: str | None = None,
    queue: str = "default",
    max_attempts: int = 3,
    backoff: Backoff = DEFAULT_BACKOFF,
    timeout: float | None = None,
    limit_key: LimitKey = None,
    concurrency: int | None = None,
    rate: str | None = None,
    internal: bool = False,
    lease: str | Needs | None = None,
) -> Callable[[Any], Any]:
    """Register the decorated function as the handler of jobs named `name`.

    It is called with the job's payload; what it returns (JSON) is kept as the result.
    It runs in a worker thread, so it may block; `timeout` fails an attempt that runs
    longer (the thread itself cannot be stopped: its late outcome is ignored). An
    `async def` handler runs on the worker's event loop instead, counted in the same
    concurrency; past its timeout it is cancelled.
    `limit_key` (a string, or a function of the payload) names the key its jobs count
    by: at most `concurrency` of a key run at once, and at most `rate` ("10/m") start
    per period, across every worker (see leases.tasks.jobs.limits). These settings apply
    to every job of the name, whoever enqueues it: a push, a pipeline, a schedule.

    `internal` marks jobs an app makes for its own bookkeeping (a pipeline's advance
    event): job lists and counts meant for operators leave them out unless asked.

    `lease` (a pool's name, or `Needs(...)`) makes each job hold a resource of that pool
    while it runs: it is claimed only together with a lease on a qualifying free one (see
    leases.tasks.needs). A handler with a parameter named `ctx` receives its attempt's
    context (`leases.tasks.context.JobContext`), its lease included; through it the
    handler is durable: its steps, sleeps and waits for events outlive the attempt.

    Above a Django task (``@handler(concurrency=1)`` over ``@task()``), without a name, it
    sets the limits of that task's jobs; `limit_key` is then a function of the task's
    arguments. Its queue stays the task's, its attempts, backoff and timeout the backend's.
    """
    if limit_key is not None and not callable(limit_key):
        limits.check_limit_key(limit_key)
    shared = dict(limit_key=limit_key, concurrency=limits.check_concurrency(concurrency), rate=limits.check_rate(rate),
                  needs=needs_of(lease))
    own = dict(queue=queue, max_attempts=max_attempts, backoff=backoff, timeout=timeout, internal=internal)

    def register(func: Any) -> Any:
        if _is_task(func):
            _register_task(func, name, own, shared)
            return func
        if name is None:
            raise ValueError(f"@handler() of {_qualname(func)} needs a name: the name its jobs are pushed by")
        check_name(name, "handler name", JOB_NAME_LENGTH)
        if inspect.isasyncgenfunction(func):
            raise ValueError(f"handler {name!r}: {_qualname(func)} is an async generator; a handler returns"
                             " one result: make it an `async def` that returns")
        spec = Handler(name=name, func=func, queue=check_queue(queue), max_attempts=check_attempts(max_attempts),
                       backoff=check_backoff(backoff), timeout=check_timeout(timeout), internal=internal,
                       takes_context=_takes_context(func), is_async=inspect.iscoroutinefunction(func), **shared)
        existing = _HANDLERS.get(name)
        if existing is not None and existing.func is not func and _qualname(existing.func) != _qualname(func):
            raise ValueError(f"handler {name!r} is already registered to {_qualname(existing.func)}")
        _HANDLERS[name] = spec
        return func

    return register


def _takes_context(func: Callable[..., Any]) -> bool:
    """Whether `func` has a parameter named `ctx` (it then receives its attempt's context)."""
    try:
        return "ctx" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _is_task(func: Any) -> bool:
    """A Django Tasks `Task` (of django.tasks or the backport), told apart without
    importing the framework, which is optional."""
    return hasattr(func, "module_path") and callable(getattr(func, "enqueue", None))


def _register_task(task: Any, name: str | None, own: dict[str, Any], shared: dict[str, Any]) -> None:
    given = [option for option, default in (("queue", "default"), ("max_attempts", 3), ("backoff", DEFAULT_BACKOFF),
                                             ("timeout", None), ("internal", False)) if own[option] != default]
    if name is not None or given:
        raise ValueError(f"@handler() above the Django task {task.module_path} takes only limit_key, concurrency"
                         " and rate: its queue is @task(queue_name=...), its attempts, backoff and timeout are"
                         " the OPTIONS of its TASKS entry")
    shared = {**shared, "limit_key": _of_arguments(shared["limit_key"])}
    needs = shared["needs"]
    if needs is not None:  # its keys are functions of the task's arguments, as limit_key's
        shared["needs"] = replace(needs, target=_of_arguments(needs.target), affinity=_of_arguments(needs.affinity))
    _TASKS[task.module_path] = TaskLimits(**shared)


def _of_arguments(key: Any) -> Any:
    """A key function of a Django task's arguments as one of its job's payload
    ({"args": [...], "kwargs": {...}}); anything else as it is."""
    if not callable(key):
        return key
    return lambda payload, key=key: key(*payload["args"], **payload["kwargs"])


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
        known = ", ".join(sorted(n for n, spec in _HANDLERS.items() if not spec.internal)[:10]) or "none registered"
        raise UnknownHandler(f"no handler named {name!r} (known: {known})")
    return found


def find(name: str) -> Handler | None:
    """The handler registered as `name`, or None."""
    discover()
    return _HANDLERS.get(name)


def registered() -> dict[str, Handler]:
    discover()
    return dict(_HANDLERS)


def internal_names() -> frozenset[str]:
    """The names of jobs apps make for their own bookkeeping (see `handler`'s `internal`)."""
    discover()
    return frozenset(name for name, spec in _HANDLERS.items() if spec.internal)


def task_pools() -> set[str]:
    """The pools Django tasks' jobs need (`@handler(lease=...)` above `@task()`)."""
    return {limits.needs.pool for limits in _TASKS.values() if limits.needs is not None}


def task_limits(module_path: str) -> TaskLimits:
    """The limits `@handler` set on the Django task at `module_path` (none by default)."""
    return _TASKS.get(module_path) or TaskLimits()


# -- what apps add ----------------------------------------------------------------------

_RUNNERS: dict[str, Callable[[Any], Any]] = {}
_READERS: dict[str, Callable[[Any, list[Any]], None]] = {}
_FINISHERS: dict[str, Callable[[Any, list[tuple[int, str]]], None]] = {}


def add_runner(backend: str, factory: Callable[[Any], Any]) -> None:
    """Run jobs whose `backend` is `backend` with `factory(claimed job)`: an object with
    `run(job)`, `delay(attempt)` and `timeout`, as a Handler has."""
    _RUNNERS[backend] = factory


def runner(backend: str) -> Callable[[Any], Any] | None:
    return _RUNNERS.get(backend)


def add_claim_reader(backend: str, reader: Callable[[Any, list[Any]], None]) -> None:
    """Have `reader(cursor, claimed jobs of backend)` read, in the claim's transaction and
    with one statement for the batch, what the backend's runner would otherwise read per
    job as it starts; it keeps that on each job's `read`. Database errors only."""
    _READERS[backend] = reader


def claim_reader(backend: str) -> Callable[[Any, list[Any]], None] | None:
    return _READERS.get(backend)


def add_finisher(on_finish: str, finisher: Callable[[Any, list[tuple[int, str]]], None]) -> None:
    """Handle the endings of jobs whose `on_finish` is `on_finish` with
    `finisher(cursor, [(job id, queue), ...])`, called in the transaction that ends them,
    instead of queueing one follow-up job per ending. It must only write through the
    cursor's connection and raise nothing but database errors: the outcomes it rides
    with are retried, or written one by one, when it raises."""
    _FINISHERS[on_finish] = finisher


def finisher(on_finish: str) -> Callable[[Any, list[tuple[int, str]]], None] | None:
    return _FINISHERS.get(on_finish)


@dataclass(frozen=True)
class Target:
    """Something a schedule may start besides a handler's job, registered by the app that
    owns it (a pipeline, by leases.pipelines): a tick pushes a job of `handler`, whose
    payload `payload(name, context, key)` makes, and the handler starts it. `check(name)`
    is the target's name as the schedule keeps it, or ValueError naming the known ones.
    `queue(name)` is the queue that job goes on when the schedule names none (one the
    target's own work uses, so its workers start it), None when this process cannot tell."""

    kind: str
    handler: str
    check: Callable[[str], str]
    payload: Callable[[str, Any, str], dict[str, Any]]
    queue: Callable[[str], str | None] = lambda name: None


_TARGETS: dict[str, Target] = {}


def add_target(target: Target) -> None:
    _TARGETS[target.kind] = target


def target(kind: str) -> Target:
    """The target of `kind`; ValueError when no installed app registers one."""
    try:
        return _TARGETS[kind]
    except KeyError:
        raise ValueError(f"scheduling a {kind} needs the app that runs them in INSTALLED_APPS"
                         f" (leases.{kind}s)") from None
