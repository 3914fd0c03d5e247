"""Statements of durable handlers (leases.tasks.jobs.steps)."""
from __future__ import annotations

# Durable handlers (see leases.tasks.jobs.steps): steps written fenced by the job's claim,
# events kept until a wait takes one, and a job suspended by a sleep or a wait.
_FENCE = "SELECT 1 FROM {j} WHERE id = %s AND claims = %s AND status = {job.running}"
STEPS = {
    # A job's steps in order, and whether each one's end (a sleep's or a wait's) has come.
    # params: job
    "of_job": (
        "SELECT seq, name, result, done, until, CASE WHEN until <= {now} THEN 1 ELSE 0 END FROM {s}"
        " WHERE job_id = %s ORDER BY seq"
    ),
    # A completed step, only while the attempt's claim is current. params: job, seq, name,
    # result, then the fence (job, claims)
    "record": (
        "INSERT INTO {s} (job_id, seq, name, result, done, until, at) SELECT %s, %s, %s, {json}, TRUE, NULL, {now}"
        " FROM {j} WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # A sleep or a wait begun, ending `seconds` from now (a long way off for a wait without
    # a timeout). params: job, seq, name, seconds, then the fence
    "begin": (
        "INSERT INTO {s} (job_id, seq, name, result, done, until, at) SELECT %s, %s, %s, NULL, FALSE, {later},"
        " {now} FROM {j} WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # ... or ending at a moment the handler gave. params: job, seq, name, moment, then the fence
    "begin_at": (
        "INSERT INTO {s} (job_id, seq, name, result, done, until, at) SELECT %s, %s, %s, NULL, FALSE, %s, {now}"
        " FROM {j} WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # Its end, read back. params: job, seq
    "until": "SELECT until FROM {s} WHERE job_id = %s AND seq = %s",
    # Whether it is done, and its result. params: job, seq
    "step": "SELECT done, result FROM {s} WHERE job_id = %s AND seq = %s",
    # A begun sleep or wait done (a wait's event data, or its timeout). params: result,
    # job, seq, then the fence
    "finish": (
        "UPDATE {s} SET result = %s, done = TRUE, at = {now} WHERE job_id = %s AND seq = %s AND done = FALSE"
        " AND EXISTS (" + _FENCE + ")"
    ),
    # The oldest event of a name a job's waits have not taken, locked. params: job, name
    "next_event": (
        "SELECT id, data FROM {e} WHERE job_id = %s AND name = %s AND taken_seq IS NULL ORDER BY id LIMIT 1{for_update}"
    ),
    # params: seq, event
    "take_event": "UPDATE {e} SET taken_seq = %s WHERE id = %s AND taken_seq IS NULL",
    # params: job, name, data
    "send": "INSERT INTO {e} (job_id, name, data, sent_at) VALUES (%s, %s, %s, {now}){returning}",
    # Which of these events, sent by earlier tries of one send, are stored: one whose
    # COMMIT's reply was lost is. Completed with ids.
    "sent": "SELECT id FROM {e} WHERE id IN (",
    # The job an event goes to, locked (so a suspension decides after it, or it after the
    # suspension). params: job
    "lock_job": "SELECT status, waiting_for, queue FROM {j} WHERE id = %s{for_update}",
    # A job that waits for this event runs now, waiting for nothing but a worker (so operators
    # no longer read it as waiting). params: job, what it waits for ("event:<name>")
    "wake": (
        "UPDATE {j} SET run_at = {now}, waiting_for = '' WHERE id = %s AND status = {job.ready}"
        " AND waiting_for = %s"
    ),
    # The unfinished job of a key (send_event by key). params: key
    "by_key": "SELECT id FROM {j} WHERE dedupe_key = %s AND finished_at IS NULL ORDER BY id DESC LIMIT 1",
    # A sleep or a wait suspends the attempt: back to ready until its end (or an event),
    # the try given back, the resource released by the caller. params: run time, what it
    # waits for ("sleep", "event:<name>"), then job, claims
    "suspend": (
        "UPDATE {j} SET status = {job.ready}, run_at = %s, waiting_for = %s, attempt = CASE WHEN attempt > 0"
        " THEN attempt - 1 ELSE 0 END, worker = '', expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # ... unless the event it waits for came meanwhile. params: job, name
    "pending": "SELECT 1 FROM {e} WHERE job_id = %s AND name = %s AND taken_seq IS NULL",
    # params: job
    "run_now": "UPDATE {j} SET run_at = {now}, waiting_for = '' WHERE id = %s AND status = {job.ready}",
    # An operator asks running attempts to stop (the worker learns it at its heartbeat); one
    # asked before counts again, keeping when it was first asked. Completed with ids.
    "request_cancel": (
        "UPDATE {j} SET cancel_requested_at = COALESCE(cancel_requested_at, {now})"
        " WHERE status = {job.running} AND id IN ("
    ),
    # Which of a worker's running jobs were asked to stop. params: worker, then ids
    "cancel_requested": (
        "SELECT id FROM {j} WHERE status = {job.running} AND worker = %s AND cancel_requested_at IS NOT NULL"
        " AND id IN ("
    ),
    # A cancelled attempt ends its job, cancelled. params: job, claims
    "end_cancelled": (
        "UPDATE {j} SET status = {job.cancelled}, finished_at = {now}, expires_at = NULL, pending_key = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # Steps and events go with their jobs. Completed with ids.
    "delete_steps": "DELETE FROM {s} WHERE job_id IN (",
    "delete_events": "DELETE FROM {e} WHERE job_id IN (",
}
