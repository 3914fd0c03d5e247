"""Statements of schedules' runs (leases.tasks.schedules)."""
from __future__ import annotations

_FROM_JOB = "(SELECT j.{col} FROM {j} j WHERE j.id = {r}.job_id)"

# A schedule's runs (see leases.tasks.schedules).
SCHEDULES = {
    # Drop runs older than a schedule's newest N (no subtraction: the columns are unsigned).
    # params: N, then schedule ids
    "trim_runs": (
        "DELETE FROM {r} WHERE number + %s <= (SELECT s.fires FROM {s} s WHERE s.id = {r}.schedule_id)"
        " AND schedule_id IN ("
    ),
    # Copy how the runs' jobs ended; a job deleted while it waited was discarded. params: job ids
    "runs_ended": (
        "UPDATE {r} SET status = COALESCE((SELECT CASE j.status WHEN {job.succeeded} THEN {run.succeeded}"
        " WHEN {job.failed} THEN {run.failed} WHEN {job.dead} THEN {run.dead} WHEN {job.cancelled}"
        " THEN {run.cancelled} END FROM {j} j WHERE j.id = {r}.job_id), {run.discarded}),"
        " started_at = " + _FROM_JOB.replace("{col}", "started_at") + ","
        " finished_at = COALESCE(" + _FROM_JOB.replace("{col}", "finished_at") + ", {now})"
        " WHERE job_id IN ("
    ),
    # params: job ids
    "failed_jobs": "SELECT id FROM {j} WHERE status IN ({job.failed}, {job.dead}) AND id IN (",
}
