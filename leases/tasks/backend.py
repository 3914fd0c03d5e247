"""A backend for Django's Tasks framework on the leases job queue.

``django.tasks`` on Django 6.x, the ``django-tasks`` backport on Django 5.2: chosen here,
once, at import. A task result is a `Job` row (its id is the job's id), so tasks get
what the queue gives every job: priorities, delays, retries with backoff, crash recovery,
and `manage.py leases_worker`, which runs native jobs and tasks side by side.

Settings::

    TASKS = {"default": {
        "BACKEND": "leases.tasks.backend.DatabaseBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"max_attempts": 1, "backoff": 10.0, "timeout": None},
    }}

Its entries are checked by `leases.conf` at `manage.py check`. A task's jobs are made by
the one maker of job rows; `@handler(limit_key=..., concurrency=..., rate=...)` above
`@task()` gives them per-key limits, as a handler's jobs have. On Django 6.1, whose
`@task(...)` passes its other arguments to the backend's `task_class`, the task itself
can carry them, and its own attempts, backoff and timeout (`DatabaseTask`).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

try:  # Django 6.x
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started

    #: Whether `@task(...)` hands the arguments it does not know to the backend's
    #: `task_class` (Django 6.1; 6.0 has `task_class` but passes it nothing more).
    TASK_OPTIONS = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(task).parameters.values())
except ImportError:  # Django 5.2 with the backport
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

    TASK_OPTIONS = False  # the backport 0.12 would pass them too; Django 5.2 stays as it was

from leases import conf
from leases.exceptions import BadResult, Banned, Cancelled, Fail, QueueFull, Suspend
from leases.validation import Backoff, check_attempts, check_backoff, check_timeout

from . import registry
from .jobs.payload import dump_payload
from .jobs.push import new_job, submit
from .models import Job
from .needs import Needs

BACKEND = conf.TASKS_BACKEND

_STATUS = {
    Job.READY: TaskResultStatus.READY,
    Job.RUNNING: TaskResultStatus.RUNNING,
    Job.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    Job.FAILED: TaskResultStatus.FAILED,
    Job.DEAD: TaskResultStatus.FAILED,
    Job.CANCELLED: TaskResultStatus.FAILED,
}


@dataclass(frozen=True)
class TaskJobSettings:
    """What a task's job takes from the backend's OPTIONS and the limits `@handler` set on
    the task (see leases.tasks.registry), for the one maker of job rows."""

    queue: str
    max_attempts: int
    limit_key: Any = None
    concurrency: int | None = None
    rate: str = ""
    needs: Any = None


#: The options of `DatabaseTask` that are per-key limits, as `@handler(...)` takes them.
_LIMITS = ("limit_key", "concurrency", "rate", "lease")
#: The limits each `DatabaseTask` registered, by path: a `@handler(...)` stacked above it
#: replaces them in the registry, and this tells the two apart.
_OWN_LIMITS: dict[str, registry.TaskLimits] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class DatabaseTask(Task):
    """A task that carries its jobs' options (Django 6.1+, the backend's `task_class`):
    ``@task(concurrency=1, limit_key=lambda site: site, lease="proxies", max_attempts=5)``.

    The limits mean what `@handler(...)`'s do above a task, and are registered the same
    way, since workers read a task's lease from the registry. `max_attempts`, `backoff`
    and `timeout` override the backend's OPTIONS for this task; None keeps them. A bad
    value is InvalidTask where the task is defined, not at its first enqueue.
    """

    limit_key: registry.LimitKey = None
    concurrency: int | None = None
    rate: str | None = None
    lease: str | Needs | None = None
    max_attempts: int | None = None
    backoff: Backoff | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        try:
            if self.max_attempts is not None:
                check_attempts(self.max_attempts)
            if self.backoff is not None:
                object.__setattr__(self, "backoff", check_backoff(self.backoff))
            object.__setattr__(self, "timeout", check_timeout(self.timeout))
        except ValueError as exc:
            raise InvalidTaskError(f"task {self.module_path}: {exc}") from None
        Task.__post_init__(self)  # the framework's checks (slots=True rules out a bare super())
        self.limits()

    def limits(self) -> registry.TaskLimits:
        """Its jobs' limits: its own if it sets any (registered on first call), else those
        of a `@handler(...)` above it. Both at once is InvalidTask: the registry, which
        workers read, holds one set per task, so they could not be merged everywhere."""
        path = self.module_path
        found = registry.task_limits(path)
        if found is _OWN_LIMITS.get(path) or all(getattr(self, name) is None for name in _LIMITS):
            return found
        if path in _OWN_LIMITS or found != registry.TaskLimits():
            raise InvalidTaskError(f"task {path} has limits from both @handler(...) above it and @task(...):"
                                   " give them in one place")
        try:
            registry.handler(**{name: getattr(self, name) for name in _LIMITS})(self)
        except ValueError as exc:
            raise InvalidTaskError(f"task {path}: {exc}") from None
        _OWN_LIMITS[path] = registry.task_limits(path)
        return _OWN_LIMITS[path]


def _option(task: Task, name: str, default: Any) -> Any:
    """A task's own max_attempts, backoff or timeout (a `DatabaseTask`'s), else the
    backend's: a plain Task, moved here with `.using(backend=...)`, has none."""
    own = getattr(task, name, None)
    return default if own is None else own


class DatabaseBackend(BaseTaskBackend):
    """Tasks stored as jobs of the leases queue and run by `manage.py leases_worker`."""

    supports_defer = True
    supports_priority = True
    supports_get_result = True
    supports_async_task = True
    if TASK_OPTIONS:
        task_class = DatabaseTask

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        try:
            options, self.using = conf.tasks_database(alias, params)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        self.max_attempts, self.backoff, self.timeout = options.max_attempts, options.backoff, options.timeout

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Write the task as a job (visible when the caller's transaction commits)."""
        self.validate_task(task)
        limits = task.limits() if isinstance(task, DatabaseTask) else registry.task_limits(task.module_path)
        settings = TaskJobSettings(task.queue_name, _option(task, "max_attempts", self.max_attempts),
                                   limits.limit_key, limits.concurrency, limits.rate, limits.needs)
        try:
            job = new_job(
                task.module_path, {"args": list(args), "kwargs": dict(kwargs)}, settings=settings,
                queue=task.queue_name, key=f"task:{uuid.uuid4().hex}",  # every enqueue is a task of its own
                priority=task.priority, run_at=task.run_after, backend=self.alias,
            )
        except ValueError as exc:
            raise InvalidTaskError(f"task {task.module_path} cannot be enqueued: {exc}") from None
        stored = submit(job, self.using)
        if stored is None:
            raise QueueFull(f"queue {task.queue_name!r} is full; the task waits in this process")
        result = _result(task, stored, [], [])
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's state as its job row tells it now; TaskResultDoesNotExist for an
        id this backend never gave (or whose job was pruned)."""
        try:
            job = Job.objects.using(self.using).get(pk=int(result_id), backend=self.alias)
        except (ValueError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        return result_of(job)


def _result(task: Task, job: Job, errors: list, workers: list[str]) -> TaskResult:
    payload = job.payload or {}
    result = TaskResult(
        task=task,
        id=str(job.pk),
        status=_STATUS[job.status],
        enqueued_at=job.enqueued_at,
        started_at=job.started_at,
        finished_at=job.finished_at if job.status in Job.FINISHED else None,
        last_attempted_at=job.started_at,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=job.backend,
        errors=errors,
        worker_ids=workers,
    )
    if job.status == Job.SUCCEEDED:
        object.__setattr__(result, "_return_value", job.result)
    return result


def _task(job: Any) -> Task:
    found = import_string(job.name)
    if not isinstance(found, Task):
        raise ImportError(f"{job.name} is not a task")
    return found.using(priority=job.priority, queue_name=job.queue, backend=job.backend)


def result_of(job: Job) -> TaskResult:
    """The TaskResult of a job row: one TaskError and one worker id per failed attempt."""
    errors = list(job.errors.order_by("attempt"))
    workers = [error.worker for error in errors]
    if job.worker and job.status in (Job.RUNNING, Job.SUCCEEDED):
        workers.append(job.worker)
    return _result(
        _task(job),
        job,
        [TaskError(exception_class_path=e.exception, traceback=e.traceback) for e in errors],
        workers,
    )


class TaskHandler:
    """Runs one claimed task job for the worker, sending the framework's signals. An
    `async def` task runs on the worker's event loop: `run` then returns its coroutine.
    Its timeout and backoff are the task's own, else the backend's."""

    def __init__(self, backend: DatabaseBackend, task: Task) -> None:
        self.backend = backend
        self.timeout = _option(task, "timeout", backend.timeout)
        self.backoff = _option(task, "backoff", backend.backoff)
        self.is_async = inspect.iscoroutinefunction(task.func)

    def delay(self, attempt: int) -> float:
        return registry.retry_delay(self.backoff, attempt)

    def run(self, claimed: Any) -> Any:
        job = Job.objects.using(self.backend.using).get(pk=claimed.id)
        job.status, job.worker = Job.RUNNING, claimed.worker
        result = result_of(job)
        task_started.send(type(self.backend), task_result=result)
        args = ((TaskContext(task_result=result),) if result.task.takes_context else ()) + tuple(result.args)
        if self.is_async:
            return self._arun(claimed, result, args)
        try:
            value = result.task.call(*args, **result.kwargs)
        except BaseException as exc:
            self._failed(claimed, result, exc)
            raise
        return self._succeeded(claimed, result, value)

    async def _arun(self, claimed: Any, result: TaskResult, args: tuple) -> Any:
        try:
            value = await result.task.acall(*args, **result.kwargs)
        except BaseException as exc:  # signals' receivers may use the ORM: off the loop
            await asyncio.to_thread(self._failed, claimed, result, exc)
            raise
        return await asyncio.to_thread(self._succeeded, claimed, result, value)

    def _succeeded(self, claimed: Any, result: TaskResult, value: Any) -> Any:
        try:
            value = json.loads(dump_payload(value, "the task's return value"))
        except ValueError as exc:
            bad = BadResult(str(exc))
            self._failed(claimed, result, bad)
            raise bad from None
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        object.__setattr__(result, "finished_at", datetime.now().astimezone())
        task_finished.send(type(self.backend), task_result=result)
        return value

    def _failed(self, claimed: Any, result: TaskResult, exc: BaseException) -> None:
        if isinstance(exc, (Suspend, Banned)):
            return  # a durable sleep or wait, or a banned resource: the task goes on later
        if isinstance(exc, (Fail, BadResult, Cancelled)) or claimed.attempt >= claimed.max_attempts:
            # the task's end (a retried attempt is not)
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            result.errors.append(TaskError(exception_class_path=_path(exc), traceback=_trace(exc)))
            task_finished.send(type(self.backend), task_result=result)


def _path(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def task_handler(job: Any) -> TaskHandler:
    """The worker's entry point for a job whose `backend` names a TASKS alias."""
    backend = task_backends[job.backend]
    if not isinstance(backend, DatabaseBackend):
        raise ImproperlyConfigured(f"TASKS[{job.backend!r}] is not {BACKEND}")
    return TaskHandler(backend, _task(job))
