"""The statements on the pipelines' hot paths, as SQL: a task's payload when its job runs,
its outcome when its job ends, and the advance event's steps at each stage's end. They
run once per task or stage, where the ORM's query building costs more than the database
does; the rarer steps (failures, operators' actions) use the ORM.

Statuses appear by name: {task.queued} is `TaskStatus.QUEUED` as an SQL literal, and
likewise {stage.running}, {run.running}, {job.succeeded}. Lists of ids are appended at
run time, one placeholder per value; only table names are put into the text.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from leases.sql import register, statements
from leases.tasks.models import JobStatus

from .models import RunStatus, StageStatus, TaskStatus

_FROM_JOB = "(SELECT j.{col} FROM {j} j WHERE j.id = {t}.job_id)"


def _copied(*columns: str) -> str:
    """`col = <the job's col>` for each column, as correlated reads of the task's job."""
    return ", ".join(f"{task} = {_FROM_JOB.replace('{col}', job)}" for task, job in columns)


PIPELINE = {
    # What the handler of a task needs that changes: params task id
    "task": (
        "SELECT t.status, t.item, r.status, r.context, r.queued_at FROM {t} t JOIN {r} r ON r.id = t.run_id"
        " WHERE t.id = %s"
    ),
    # ... of the tasks a worker just claimed, with their ids first. params: task ids
    "tasks": (
        "SELECT t.id, t.status, t.item, r.status, r.context, r.queued_at FROM {t} t JOIN {r} r ON r.id = t.run_id"
        " WHERE t.id IN ("
    ),
    # A run's definition never changes, so a process reads it once. params: run id
    "definition": "SELECT definition FROM {r} WHERE id = %s",
    # ... the definitions of several runs at once. params: run ids
    "definitions": "SELECT id, definition FROM {r} WHERE id IN (",
    # The queued tasks of jobs that just ended, and how each job ended (NULL: deleted).
    # params: job ids
    "ended": (
        "SELECT t.id, t.run_id, t.stage_id, t.job_id, j.status FROM {t} t LEFT JOIN {j} j ON j.id = t.job_id"
        " WHERE t.status = {task.queued} AND t.job_id IN ("
    ),
    # Record tasks whose jobs succeeded, copying what the job rows say. params: task ids
    "succeeded": (
        "UPDATE {t} SET status = {task.succeeded}, error = '', "
        + _copied(("result", "result"), ("attempts", "attempt"), ("started_at", "started_at"),
                  ("finished_at", "finished_at"))
        + " WHERE status = {task.queued} AND id IN ("
    ),
    # ... and tasks whose waiting jobs were cancelled. params: task ids
    "cancelled": (
        "UPDATE {t} SET status = {task.cancelled}, error = 'its job was cancelled', result = NULL,"
        " started_at = NULL, " + _copied(("attempts", "attempt"), ("finished_at", "finished_at"))
        + " WHERE status = {task.queued} AND id IN ("
    ),
    # The stages whose tasks were just recorded, locked in id order before their counters
    # move (one UPDATE for all, `update_each`); completed with the stage ids, the order and
    # the dialect's FOR UPDATE. params: stage ids
    "counted": "SELECT id, run_id, status, pending, waiting, done, failed_tasks FROM {s} WHERE id IN (",
    # -- a hand-over in the transaction that ended a stage's last task --
    # Running runs among these, locked where no one holds them; completed with the
    # columns (see store.load), then the run ids, the order and the dialect's SKIP LOCKED.
    # params: run ids
    "free_runs": "FROM {r} WHERE status = {run.running} AND id IN (",
    # The stages of those runs that no one holds, locked; completed likewise.
    # params: run ids
    "free_stages": "FROM {s} WHERE run_id IN (",
    # -- the advance event's steps, once per stage of every run --
    # The run's lock: a write (see store.locked). params: run id
    "lock_run": "UPDATE {r} SET revision = revision + 1 WHERE id = %s",
    # The trace contexts of runs whose advance events are pushed (only when tracing is
    # on). Completed with the run ids.
    "run_traceparents": "SELECT id, traceparent FROM {r} WHERE id IN (",
    # A run's row, completed with its columns (see store.load). params: run id
    "run_by_id": "FROM {r} WHERE id = %s",
    # A run's stages, in definition order; completed with the columns. params: run id
    "run_stages": "FROM {s} WHERE run_id = %s ORDER BY position",
    # A stage's tasks were made: it runs. params: total, pending, waiting, queued_at, stage id
    "stage_started": (
        "UPDATE {s} SET status = {stage.running}, total = %s, pending = %s, waiting = %s, queued_at = %s"
        " WHERE id = %s AND status = {stage.waiting}"
    ),
    # Its tasks all finished; it started when its first task did. params: status,
    # finished_at, error, stage id, stage id
    "stage_ended": (
        "UPDATE {s} SET status = %s, finished_at = %s, error = %s,"
        " started_at = (SELECT MIN(started_at) FROM {t} WHERE stage_id = %s)"
        " WHERE id = %s AND status = {stage.running}"
    ),
    # A stage's next tasks to queue, in order. params: stage id, how many
    "next_waiting": (
        "SELECT id, task FROM {t} WHERE stage_id = %s AND status = {task.waiting} ORDER BY position LIMIT %s"
    ),
    # params: how many were queued, stage id
    "took_waiting": "UPDATE {s} SET waiting = waiting - %s WHERE id = %s",
    # The items of tasks about to be queued (a limit key computed from them). params: task ids
    "items": "SELECT id, item FROM {t} WHERE id IN (",
    # -- the run's end --
    # params: status, error, finished_at, whether its key is freed, run id
    "end_run": (
        "UPDATE {r} SET status = %s, error = %s, finished_at = %s,"
        " live_key = CASE WHEN %s THEN NULL ELSE live_key END"
        " WHERE id = %s AND status IN ({run.running}, {run.paused})"
    ),
    # Its tasks not queued yet will not be. params: their status, finished_at, run id
    "end_waiting": "UPDATE {t} SET status = %s, finished_at = %s WHERE run_id = %s AND status = {task.waiting}",
    # The jobs of its queued tasks, to cancel those still waiting. params: run id
    "queued_jobs": "SELECT job_id FROM {t} WHERE run_id = %s AND status = {task.queued}",
    # Its stages that had not ended. params: finished_at, run id
    "end_stages": (
        "UPDATE {s} SET status = {stage.cancelled}, finished_at = %s WHERE run_id = %s"
        " AND status IN ({stage.waiting}, {stage.running})"
    ),
    # When it started: when its first task did. params: run id
    "first_start": "SELECT MIN(started_at) FROM {t} WHERE run_id = %s",
    # params: started_at, run id
    "run_started": "UPDATE {r} SET started_at = %s WHERE id = %s",
}

register("pipeline", PIPELINE, {
    "r": "leases_pipelines.Run", "s": "leases_pipelines.StageRun", "t": "leases_pipelines.TaskRun",
    "j": "leases_tasks.Job",
}, {"run": RunStatus, "stage": StageStatus, "task": TaskStatus, "job": JobStatus})


def pipeline(connection: Any) -> SimpleNamespace:
    """The pipelines' statements for `connection`'s vendor."""
    return statements(connection, "pipeline")
