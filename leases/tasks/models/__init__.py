"""State of leases.tasks, one module per concept; behaviour lives in the plain modules.

- `dispatch`: the dispatcher's pools, tasks and workers (`leases.tasks.dispatcher`)
- `jobs`: queues, jobs and their errors (`leases.tasks.jobs`)
- `workers`: the rows of running `leases_worker` processes (`leases.tasks.jobs.recovery`)
- `schedules`: schedules and their runs (`leases.tasks.schedules`)
- `limits`: operators' key rules and the limited keys (`leases.tasks.jobs.limits`)
- `leasing`: affinities and turns of jobs that hold resources (`leases.tasks.jobs.leasing`)
- `durable`: steps and events of durable handlers (`leases.tasks.jobs.steps`)
"""
from .dispatch import NAME_LENGTH, VALUE_LENGTH, WORKER_LENGTH, DispatchWorker, PoolTask, TaskPool, TaskState
from .durable import STEP_NAME_LENGTH, JobEvent, JobStep
from .jobs import (
    AFFINITY_LENGTH,
    JOB_NAME_LENGTH,
    KEY_LENGTH,
    PRIORITY_RANGE,
    Job,
    JobError,
    JobStatus,
    JobStatusField,
    Queue,
)
from .leasing import Affinity, PoolTurn
from .limits import LimitKey, LimitRule
from .schedules import RunStatus, Schedule, ScheduleRun
from .workers import Worker

__all__ = [
    "AFFINITY_LENGTH", "JOB_NAME_LENGTH", "KEY_LENGTH", "NAME_LENGTH", "PRIORITY_RANGE", "STEP_NAME_LENGTH",
    "VALUE_LENGTH", "WORKER_LENGTH", "Affinity", "DispatchWorker", "Job", "JobError", "JobEvent", "JobStatus",
    "JobStatusField", "JobStep", "LimitKey", "LimitRule", "PoolTask", "PoolTurn", "Queue", "RunStatus", "Schedule",
    "ScheduleRun", "TaskPool", "TaskState", "Worker",
]
