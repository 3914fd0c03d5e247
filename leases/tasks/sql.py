"""The job queue, as the SQL statements it runs (the dispatcher's live in dispatcher.py).

Status codes are those of `Job`: 0 ready, 1 running, 2 succeeded, 3 failed, 4 dead,
5 cancelled. Every transition of a running job names the claim it ends (`id = %s AND
claims = %s AND status = 1`), so an attempt that was recovered and run again elsewhere
cannot overwrite the newer outcome. Lists of ids or (id, claims) pairs are appended at
run time, one placeholder per value.
"""
from __future__ import annotations

from leases.sql import register

JOB = {
    # One row per job, completed with "row" or "row_at" per job and then "insert_tail".
    "insert": (
        "INSERT INTO {j} (queue, name, backend, on_finish, payload, dedupe_key, pending_key, priority,"
        " limit_key, concurrency, rate, max_attempts, run_at, status, attempt, claims, pushes, worker,"
        " enqueued_at) VALUES "
    ),
    # A new job: params queue, name, backend, on_finish, payload, key, key, priority,
    # limit key, concurrency, rate, max_attempts, then the delay ("row") or an absolute
    # run time ("row_at").
    "row": "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {later}, 0, 0, 0, 1, '', {now})",
    "row_at": "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0, 0, 0, 1, '', {now})",
    # A waiting job with the same key takes the new run time and priority (the latest
    # push says what is wanted now), keeps its name and payload, and counts the push.
    "insert_tail": " {upsert[pending_key]} run_at = {new[run_at]}, priority = {new[priority]}, pushes = pushes + 1",
    # params: pending key -> the job as the database holds it after the push
    "pushed": (
        "SELECT id, queue, name, backend, payload, dedupe_key, priority, run_at, status, attempt,"
        " max_attempts, enqueued_at, pushes FROM {j} WHERE pending_key = %s"
    ),
    # params: delay (or run time), priority, pending key: move a waiting job (dedupe when
    # its queue is full)
    "reschedule": "UPDATE {j} SET run_at = {later}, priority = %s, pushes = pushes + 1 WHERE pending_key = %s",
    "reschedule_at": "UPDATE {j} SET run_at = %s, priority = %s, pushes = pushes + 1 WHERE pending_key = %s",
    # Is the queue holding at least n waiting jobs? params: queue, n - 1
    "full": "SELECT 1 FROM {j} WHERE status = 0 AND queue = %s ORDER BY priority DESC, run_at LIMIT 1 OFFSET %s",
    # The claim, per queue: an index range scan of ready rows in claim order.
    "pick": (
        "SELECT id, priority, run_at, queue, name, backend, payload, attempt, max_attempts, dedupe_key,"
        " claims, on_finish, limit_key, concurrency, rate FROM {j} WHERE status = 0 AND queue = %s"
        " AND run_at <= {now}"
        " ORDER BY priority DESC, run_at, id LIMIT %s{skip_locked}"
    ),
    # params: worker, ttl, then ids
    "take": (
        "UPDATE {j} SET status = 1, attempt = attempt + 1, claims = claims + 1, worker = %s,"
        " pending_key = NULL, started_at = {now}, expires_at = {later} WHERE status = 0 AND id IN ("
    ),
    # After a claim whose reply was lost: what this worker holds (claimed, not yet known).
    # Running rows are few (workers x concurrency), read through the claim index's status
    # prefix. params: worker
    "mine": (
        "SELECT id, priority, run_at, queue, name, backend, payload, attempt, max_attempts, dedupe_key,"
        " claims, on_finish, limit_key, concurrency, rate FROM {j} WHERE status = 1 AND worker = %s"
    ),
    # Without SKIP LOCKED a racing claim may have won some rows. params: worker, then ids
    "taken": "SELECT id FROM {j} WHERE status = 1 AND worker = %s AND id IN (",
    # params: result, then (id, claims) pairs
    "succeed": (
        "UPDATE {j} SET status = 2, result = %s, finished_at = {now}, expires_at = NULL"
        " WHERE status = 1 AND ("
    ),
    # params: delay, id, claims
    "retry": (
        "UPDATE {j} SET status = 0, run_at = {later}, worker = '', expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = 1"
    ),
    # params: status (failed or dead), id, claims
    "bury": (
        "UPDATE {j} SET status = %s, finished_at = {now}, expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = 1"
    ),
    # A worker without the job's handler (a rolling deploy) gives it back for later, and
    # the try with it. params: delay, id, claims
    "bounce": (
        "UPDATE {j} SET status = 0, run_at = {later}, attempt = CASE WHEN attempt > 0 THEN attempt - 1"
        " ELSE 0 END, worker = '', expires_at = NULL, bounced_at = COALESCE(bounced_at, {now})"
        " WHERE id = %s AND claims = %s AND status = 1"
    ),
    # ... unless no worker has had the handler for the grace period. params: id, claims, -grace
    "unhandled": (
        "UPDATE {j} SET status = 3, finished_at = {now}, expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = 1 AND bounced_at <= {later}"
    ),
    # params: job id, attempt (the try's number), exception, message, traceback, worker
    "error": (
        "INSERT INTO {e} (job_id, attempt, exception, message, traceback, worker, at)"
        " VALUES (%s, %s, %s, %s, %s, %s, {now})"
    ),
    # A worker that shuts down hands back every attempt still running under its name (the
    # unfinished, and any whose claim reply was lost); an interrupted attempt does not use
    # up a try. Completed with "AND id NOT IN (...)" for outcomes not yet written.
    # params: worker
    "hand_back": (
        "UPDATE {j} SET status = 0, worker = '', expires_at = NULL,"
        " attempt = CASE WHEN attempt > 0 THEN attempt - 1 ELSE 0 END WHERE status = 1 AND worker = %s"
    ),
    # The limited keys of what it hands back (their slots come free). params: worker
    "handed_keys": (
        "SELECT limit_key, concurrency, rate FROM {j} WHERE status = 1 AND worker = %s AND limit_key <> ''"
    ),
    # The heartbeat extends the leases of the attempts the worker runs (or finished and has
    # yet to write), and no other: a claim it never heard back from lapses and is recovered.
    # params: ttl, worker, then ids
    "extend": "UPDATE {j} SET expires_at = {later} WHERE status = 1 AND worker = %s AND id IN (",
    # A worker whose own lease lapsed registers again and keeps the jobs nobody recovered.
    # params: new worker, old worker
    "adopt": "UPDATE {j} SET worker = %s WHERE status = 1 AND worker = %s",
    # Running attempts whose lease lapsed (their worker stopped heartbeating).
    "lapsed": (
        "SELECT id, claims, attempt, worker, max_attempts, queue, on_finish, limit_key, concurrency, rate, name"
        " FROM {j} WHERE status = 1 AND expires_at <= {now}"
        " ORDER BY id LIMIT %s{skip_locked}"
    ),
    # ... of these jobs only (an operator's choice). params: ids
    "lapsed_in": (
        "SELECT id, claims, attempt, worker, max_attempts, queue, on_finish, limit_key, concurrency, rate, name"
        " FROM {j} WHERE status = 1 AND expires_at <= {now} AND id IN ("
    ),
    # Back to ready when attempts remain, else dead. params: id, claims
    "recover": (
        "UPDATE {j} SET status = CASE WHEN attempt >= max_attempts THEN 4 ELSE 0 END,"
        " finished_at = CASE WHEN attempt >= max_attempts THEN {now} ELSE NULL END,"
        " worker = '', expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = 1 AND expires_at <= {now}"
    ),
    # Finished runs of one key beyond the newest n. params: key, n
    "old_runs": (
        "SELECT id FROM {j} WHERE dedupe_key = %s AND finished_at IS NOT NULL"
        " ORDER BY finished_at DESC, id DESC LIMIT 1000 OFFSET %s"
    ),
    # Which of these keys have more than n finished runs? Completed with the keys, then
    # "crowded_tail" (param n).
    "crowded": "SELECT dedupe_key FROM {j} WHERE finished_at IS NOT NULL AND dedupe_key IN (",
    "crowded_tail": " GROUP BY dedupe_key HAVING COUNT(*) > %s",
    # params: cutoff, batch size
    "expired": "SELECT id FROM {j} WHERE finished_at < %s ORDER BY finished_at LIMIT %s",
    "delete_errors": "DELETE FROM {e} WHERE job_id IN (",
    "delete": "DELETE FROM {j} WHERE finished_at IS NOT NULL AND id IN (",
    # Operator actions. params: ids. Waiting jobs to cancel, locked first so their
    # on_finish jobs are queued for exactly the rows cancelled.
    "cancellable": "SELECT id, queue, on_finish FROM {j} WHERE status IN (0, 6) AND id IN (",
    "cancel": (
        "UPDATE {j} SET status = 5, pending_key = NULL, finished_at = {now}"
        " WHERE status IN (0, 6) AND id IN ("
    ),
    # A finished job that did not succeed runs again now with the tries it has left, and
    # at least one: max_attempts grows only when it was used up.
    "again": (
        "UPDATE {j} SET status = 0, run_at = {now}, max_attempts = CASE WHEN max_attempts > attempt"
        " THEN max_attempts ELSE attempt + 1 END, finished_at = NULL, worker = '', result = NULL,"
        " bounced_at = NULL WHERE status IN (3, 4, 5) AND id IN ("
    ),
    "discardable": "SELECT id, status, queue, on_finish FROM {j} WHERE status <> 1 AND id IN (",
    "discard": "DELETE FROM {j} WHERE status <> 1 AND id IN (",
    # A queue's settings. params: name
    "queue": "SELECT paused, max_length, when_full, full_timeout FROM {q} WHERE name = %s",
    # Its row, made on first push; a second maker changes nothing. params: name, paused,
    # when_full, full_timeout (the model's defaults)
    "add_queue": (
        "INSERT INTO {q} (name, paused, max_length, when_full, full_timeout) VALUES (%s, %s, NULL, %s, %s)"
        " {upsert[name]} name = {new[name]}"
    ),
}

# The worker's process row is a lease, with the protocol of leases.sql (kind "worker").
WORKER = {
    # params: name, holder, queues, concurrency, ttl
    "register": (
        "INSERT INTO {w} (name, holder, token, queues, concurrency, started_at, heartbeat_at, expires_at)"
        " VALUES (%s, %s, 1, %s, %s, {now}, {now}, {later})"
    ),
    "registered": "SELECT id, {now} FROM {w} WHERE name = %s",
    # params: ttl, id, token, holder
    "renew": (
        "UPDATE {w} SET expires_at = {later}, heartbeat_at = {now}"
        " WHERE id = %s AND token = %s AND holder = %s AND expires_at > {now}"
    ),
    # params: id, token, holder
    "release": "UPDATE {w} SET expires_at = {now}, holder = '' WHERE id = %s AND token = %s AND holder = %s",
    # Rows of workers gone for a day are forgotten. params: -seconds
    "forget": "DELETE FROM {w} WHERE expires_at < {later}",
}

_FROM_JOB = "(SELECT j.{col} FROM {j} j WHERE j.id = {r}.job_id)"

# A schedule's runs (see leases.tasks.schedules).
SCHEDULE = {
    # Drop runs older than a schedule's newest N (no subtraction: the columns are unsigned).
    # params: N, then schedule ids
    "trim": (
        "DELETE FROM {r} WHERE number + %s <= (SELECT s.fires FROM {s} s WHERE s.id = {r}.schedule_id)"
        " AND schedule_id IN ("
    ),
    # Copy how the runs' jobs ended; a job deleted while it waited was discarded. params: job ids
    "ended": (
        "UPDATE {r} SET status = COALESCE((SELECT CASE j.status WHEN 2 THEN 'succeeded' WHEN 3 THEN 'failed'"
        " WHEN 4 THEN 'dead' WHEN 5 THEN 'cancelled' END FROM {j} j WHERE j.id = {r}.job_id), 'discarded'),"
        " started_at = " + _FROM_JOB.replace("{col}", "started_at") + ","
        " finished_at = COALESCE(" + _FROM_JOB.replace("{col}", "finished_at") + ", {now})"
        " WHERE job_id IN ("
    ),
    # params: job ids
    "failed": "SELECT id FROM {j} WHERE status IN (3, 4) AND id IN (",
}

register("job", JOB, {"j": "leases_tasks.Job", "e": "leases_tasks.JobError", "q": "leases_tasks.Queue"})
register("worker", WORKER, {"w": "leases_tasks.Worker"})
register("schedule", SCHEDULE, {"r": "leases_tasks.ScheduleRun", "s": "leases_tasks.Schedule", "j": "leases_tasks.Job"})
