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
`@task()` gives them per-key limits, as a handler's jobs have.
"""
from __future__ import annotations

import json
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

try:  # Django 6.x
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # Django 5.2 with the backport
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskError
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

from leases import conf
from leases.exceptions import BadResult, Fail, QueueFull

from . import registry
from .jobs.payload import dump_payload
from .jobs.push import new_job, submit
from .models import Job

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


class DatabaseBackend(BaseTaskBackend):
    """Tasks stored as jobs of the leases queue and run by `manage.py leases_worker`."""

    supports_defer = True
    supports_priority = True
    supports_get_result = True
    supports_async_task = True

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
        limits = registry.task_limits(task.module_path)
        settings = TaskJobSettings(task.queue_name, self.max_attempts, limits.limit_key, limits.concurrency,
                                   limits.rate, limits.needs)
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
    """Runs one claimed task job for the worker, sending the framework's signals."""

    def __init__(self, backend: DatabaseBackend) -> None:
        self.backend = backend
        self.timeout = backend.timeout

    def delay(self, attempt: int) -> float:
        return registry.retry_delay(self.backend.backoff, attempt)

    def run(self, claimed: Any) -> Any:
        job = Job.objects.using(self.backend.using).get(pk=claimed.id)
        job.status, job.worker = Job.RUNNING, claimed.worker
        result = result_of(job)
        sender = type(self.backend)
        task_started.send(sender, task_result=result)
        try:
            if result.task.takes_context:
                value = result.task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
            else:
                value = result.task.call(*result.args, **result.kwargs)
            try:
                value = json.loads(dump_payload(value, "the task's return value"))
            except ValueError as exc:
                raise BadResult(str(exc)) from None
        except BaseException as exc:
            final = isinstance(exc, (Fail, BadResult)) or claimed.attempt >= claimed.max_attempts
            if final:  # a retried attempt is not the end of the task
                object.__setattr__(result, "status", TaskResultStatus.FAILED)
                result.errors.append(TaskError(exception_class_path=_path(exc), traceback=_trace(exc)))
                task_finished.send(sender, task_result=result)
            raise
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        object.__setattr__(result, "_return_value", value)
        object.__setattr__(result, "finished_at", datetime.now().astimezone())
        task_finished.send(sender, task_result=result)
        return value


def _path(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def task_handler(job: Any) -> TaskHandler:
    """The worker's entry point for a job whose `backend` names a TASKS alias."""
    backend = task_backends[job.backend]
    if not isinstance(backend, DatabaseBackend):
        raise ImproperlyConfigured(f"TASKS[{job.backend!r}] is not {BACKEND}")
    return TaskHandler(backend)
