"""Every statement of leases.tasks, by kind, a module each: the job queue (`jobs`), the rows
of worker processes (`workers`) and per-key limits (`limits`) in `queue`; jobs that hold
resources (`leasing`); durable handlers' steps and events (`steps`); schedules' runs
(`schedules`); the dispatcher (`dispatch`); the dashboard's readings (`readings`). The
modules that run them say `sql.jobs(connection).claim`.

Statuses appear by name: {job.ready} is `JobStatus.READY` as an SQL literal, {task.pool}
a dispatcher task's state, {run.succeeded} a schedule run's. Every transition of a
running job names the claim it ends (`id = %s AND claims = %s AND status =
{job.running}`), so an attempt that was recovered and run again elsewhere cannot
overwrite the newer outcome. A statement whose key ends in "(" is completed at run time
with one placeholder per value (`leases.sql.in_list`). Values are always parameters.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from leases.sql import register, statements

from ..models import JobStatus, RunStatus, TaskState
from .dispatch import DISPATCH
from .leasing import LEASING
from .queue import JOBS, LIMITS, WORKERS
from .readings import READINGS
from .schedules import SCHEDULES
from .steps import STEPS

_JOB = "leases_tasks.Job"
register("job", JOBS, {"j": _JOB, "e": "leases_tasks.JobError", "q": "leases_tasks.Queue"}, {"job": JobStatus})
register("worker", WORKERS, {"w": "leases_tasks.Worker"})
register("limits", LIMITS, {"k": "leases_tasks.LimitKey", "j": _JOB}, {"job": JobStatus})
register("schedule", SCHEDULES, {"r": "leases_tasks.ScheduleRun", "s": "leases_tasks.Schedule", "j": _JOB},
         {"job": JobStatus, "run": RunStatus})
register("readings", READINGS, {"j": _JOB}, {"job": JobStatus})
register("steps", STEPS, {"j": _JOB, "s": "leases_tasks.JobStep", "e": "leases_tasks.JobEvent"},
         {"job": JobStatus})
register("leasing", LEASING, {"j": _JOB, "r": "leases.Resource", "g": "leases.ResourceTarget",
                              "a": "leases_tasks.Affinity", "p": "leases_tasks.PoolTurn"}, {"job": JobStatus})
register("dispatch", DISPATCH, {"t": "leases_tasks.PoolTask", "w": "leases_tasks.DispatchWorker",
                                "p": "leases_tasks.TaskPool"}, {"task": TaskState})


def jobs(connection: Any) -> SimpleNamespace:
    """The job queue's statements for `connection`'s vendor."""
    return statements(connection, "job")


def workers(connection: Any) -> SimpleNamespace:
    return statements(connection, "worker")


def limits(connection: Any) -> SimpleNamespace:
    return statements(connection, "limits")


def schedules(connection: Any) -> SimpleNamespace:
    return statements(connection, "schedule")


def readings(connection: Any) -> SimpleNamespace:
    return statements(connection, "readings")


def steps(connection: Any) -> SimpleNamespace:
    return statements(connection, "steps")


def leasing(connection: Any) -> SimpleNamespace:
    return statements(connection, "leasing")


def dispatch(connection: Any) -> SimpleNamespace:
    return statements(connection, "dispatch")
