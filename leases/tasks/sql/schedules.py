"""Statements of schedules and their runs (leases.tasks.schedules).

A pass fires a batch of due schedules with the same few statements however large the
batch. On PostgreSQL (its dialect's `arrays`) a statement's rows go as one JSON text
read by jsonb_to_recordset: one parameter, quoted once, where an array per column would
have the driver quote every element (a timestamp costs it some 10 us). Elsewhere a
VALUES group per run, and the batch's move as one value per column when its schedules
share them (the usual burst: the same tick, the same next one), else a CASE by id
(`leases.sql.update_each`).
"""
from __future__ import annotations

_FROM_JOB = "(SELECT j.{col} FROM {j} j WHERE j.id = {r}.job_id)"
_RUN_COLUMNS = "INSERT INTO {r} (schedule_id, number, tick_at, fired_at, job_id, status, error) "

# A schedule's runs (see leases.tasks.schedules).
SCHEDULES = {
    # -- a pass --
    # Due schedules, soonest first, locked for the pass; those another pass holds are
    # skipped. params: True, the pass's moment, how many
    "due": (
        "SELECT id, name, handler, pipeline, cron, every, at, timezone, payload, queue, priority, catch_up,"
        " next_fire_at, last_fire_at, fires FROM {s} WHERE enabled = %s AND next_fire_at <= %s"
        " ORDER BY next_fire_at LIMIT %s{skip_locked}"
    ),
    # The soonest tick of an enabled schedule, and the clock: how long the leader may sleep.
    # params: True
    "next_due": "SELECT MIN(next_fire_at), {now} FROM {s} WHERE enabled = %s",
    # Move schedules that share their next tick, last tick and ticks fired past them.
    # params: next tick, last tick, ticks fired, then the ids
    "move": "UPDATE {s} SET next_fire_at = %s, last_fire_at = %s, fires = fires + %s WHERE id IN (",
    # ... on PostgreSQL, each its own. params: JSON records {id, next, last, added}
    "move_records": (
        "UPDATE {s} SET next_fire_at = t.next, last_fire_at = t.last, fires = {s}.fires + t.added"
        " FROM jsonb_to_recordset(%s::jsonb) AS t(id bigint, next timestamptz, last timestamptz, added int)"
        " WHERE {s}.id = t.id"
    ),
    # A run per fired tick, naming the job it pushed in this transaction (the waiting job
    # its key merged into, if any). One VALUES group per run.
    "runs": _RUN_COLUMNS + "VALUES ",
    # params: schedule id, number, tick, fired at, job id
    "run_values": "(%s, %s, %s, %s, %s, {run.queued}, '')",
    # ... on PostgreSQL, which finds each job by its key in the same statement. params:
    # fired at, JSON records {schedule, number, tick, job_key}
    "runs_records": (
        _RUN_COLUMNS + "SELECT t.schedule, t.number, t.tick, %s, j.id, {run.queued}, ''"
        " FROM jsonb_to_recordset(%s::jsonb) AS t(schedule bigint, number int, tick timestamptz, job_key text)"
        " LEFT JOIN {j} j ON j.pending_key = t.job_key"
    ),
    # Drop a schedule's runs up to a number (its newest N kept), by the (schedule, number)
    # index. One group per schedule, joined by OR; params: schedule id, number, ...
    "trim": "DELETE FROM {r} WHERE ",
    "trim_one": "(schedule_id = %s AND number <= %s)",
    # ... on PostgreSQL. params: JSON records {schedule, upto}
    "trim_records": (
        "DELETE FROM {r} USING jsonb_to_recordset(%s::jsonb) AS t(schedule bigint, upto bigint)"
        " WHERE {r}.schedule_id = t.schedule AND {r}.number <= t.upto"
    ),
    # The jobs of schedules' last runs that no worker has claimed yet (catch_up "none"
    # keeps one waiting), by the (schedule, number) index. One group per schedule, joined
    # by OR, then ")"; params: schedule id, its last run's number, ...
    "waiting": (
        "SELECT r.schedule_id, j.id FROM {r} r JOIN {j} j ON j.id = r.job_id"
        " WHERE j.status IN ({job.ready}, {job.blocked}) AND j.claims = 0 AND ("
    ),
    "waiting_one": "(r.schedule_id = %s AND r.number = %s)",
    # ... on PostgreSQL. params: JSON records {schedule, number}
    "waiting_records": (
        "SELECT r.schedule_id, j.id FROM jsonb_to_recordset(%s::jsonb) AS t(schedule bigint, number bigint)"
        " JOIN {r} r ON r.schedule_id = t.schedule AND r.number = t.number JOIN {j} j ON j.id = r.job_id"
        " WHERE j.status IN ({job.ready}, {job.blocked}) AND j.claims = 0"
    ),
    # -- how runs end --
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
