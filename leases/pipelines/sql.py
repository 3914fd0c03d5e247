"""The statements on the engine's per-task paths, as SQL: a task's payload when its job
runs, and its outcome when its job ends. They run once per task, where the ORM's query
building costs more than the database does; the rest of the engine uses the ORM.

Statuses are those of `TaskRun` and `StageRun` ('queued', 'running', ...) and of `Job`
(2 succeeded, 5 cancelled). Lists of ids are appended at run time, one placeholder per
value; only table names are put into the text.
"""
from __future__ import annotations

from leases.sql import register

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
    # A run's definition never changes, so a process reads it once. params: run id
    "definition": "SELECT definition FROM {r} WHERE id = %s",
    # The queued tasks of jobs that just ended, and how each job ended (NULL: deleted).
    # params: job ids
    "ended": (
        "SELECT t.id, t.run_id, t.stage_id, t.job_id, j.status FROM {t} t LEFT JOIN {j} j ON j.id = t.job_id"
        " WHERE t.status = 'queued' AND t.job_id IN ("
    ),
    # Record tasks whose jobs succeeded, copying what the job rows say. params: task ids
    "succeeded": (
        "UPDATE {t} SET status = 'succeeded', error = '', "
        + _copied(("result", "result"), ("attempts", "attempt"), ("started_at", "started_at"),
                  ("finished_at", "finished_at"))
        + " WHERE status = 'queued' AND id IN ("
    ),
    # ... and tasks whose waiting jobs were cancelled. params: task ids
    "cancelled": (
        "UPDATE {t} SET status = 'cancelled', error = 'its job was cancelled', result = NULL, started_at = NULL, "
        + _copied(("attempts", "attempt"), ("finished_at", "finished_at"))
        + " WHERE status = 'queued' AND id IN ("
    ),
    # A stage's counters after some of its tasks were recorded; a stage that no longer
    # runs (its run ended, or it failed) counts them done and moves nothing else.
    # params: done, done, failed, stage id
    "count": (
        "UPDATE {s} SET done = done + %s,"
        " pending = CASE WHEN status = 'running' THEN pending - %s ELSE pending END,"
        " failed_tasks = CASE WHEN status = 'running' THEN failed_tasks + %s ELSE failed_tasks END"
        " WHERE id = %s"
    ),
    # params: stage ids
    "stages": "SELECT id, run_id, status, pending, waiting FROM {s} WHERE id IN (",
}

register("pipeline", PIPELINE, {
    "r": "leases_pipelines.Run", "s": "leases_pipelines.StageRun", "t": "leases_pipelines.TaskRun",
    "j": "leases_tasks.Job",
})
