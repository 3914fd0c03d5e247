"""Every statement of leases.tasks, by kind: the job queue (`jobs`), the rows of worker
processes (`workers`), per-key limits (`limits`), schedules' runs (`schedules`) and the
dispatcher (`dispatch`). The modules that run them say `sql.jobs(connection).claim`.

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

from leases.sql import USABLE_FOR, register, statements

from .models import JobStatus, RunStatus, TaskState

_CLAIMED_COLUMNS = (
    "id, priority, run_at, queue, name, backend, payload, attempt, max_attempts, dedupe_key, claims, on_finish,"
    " limit_key, concurrency, rate, traceparent, pool, target, affinity, turn, resource_id, lease_token"
)

JOBS = {
    # -- push: one row per job, a VALUES group per job ("values_after" or "values_at") --
    "insert": (
        "INSERT INTO {j} (queue, name, backend, on_finish, payload, dedupe_key, pending_key, priority,"
        " limit_key, concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, run_at, status,"
        " attempt, claims, pushes, worker, enqueued_at) VALUES "
    ),
    # params: queue, name, backend, on_finish, payload, key, key, priority, limit key,
    # concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, then the
    # delay ("after") or the run time ("at")
    "values_after": (
        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {later}, {job.ready}, 0, 0, 1, '',"
        " {now})"
    ),
    "values_at": (
        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {job.ready}, 0, 0, 1, '', {now})"
    ),
    # PostgreSQL's push (its dialect's `arrays`): one array per column, so the statement's
    # text is the same for any number of jobs and is parsed once by the driver and the
    # server (1,000 rows of 14 placeholders cost psycopg more to parse than the server to
    # write). params, one list each: queue, name, backend, on_finish, payload, key,
    # priority, limit key, concurrency, rate, max_attempts, traceparent, pool, target,
    # affinity, turn, run time (None: after the delay), delay in microseconds
    "insert_arrays": (
        "INSERT INTO {j} (queue, name, backend, on_finish, payload, dedupe_key, pending_key, priority,"
        " limit_key, concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, run_at, status,"
        " attempt, claims, pushes, worker, enqueued_at) SELECT q, n, b, f, p, k, k, pr, lk, c, r, ma, tp, po, ta,"
        " af, tu, COALESCE(t.at, {now} + t.delay * INTERVAL '1 microsecond'), {job.ready}, 0, 0, 1, '', {now}"
        " FROM unnest(%s::varchar[], %s::varchar[], %s::varchar[], %s::varchar[], %s::jsonb[], %s::varchar[],"
        " %s::smallint[], %s::varchar[], %s::int[], %s::varchar[], %s::int[], %s::varchar[], %s::varchar[],"
        " %s::varchar[], %s::varchar[], %s::bigint[], %s::timestamptz[], %s::bigint[])"
        " AS t(q, n, b, f, p, k, pr, lk, c, r, ma, tp, po, ta, af, tu, at, delay)"
    ),
    # A waiting job with the same key takes the new run time and priority (the latest
    # push says what is wanted now), keeps its name and payload, and counts the push.
    "merge_waiting": (
        " {upsert[pending_key]} run_at = {new[run_at]}, priority = {new[priority]}, pushes = {j}.pushes + 1"
    ),
    # params: pending key -> the job as the database holds it after the push
    "waiting_by_key": (
        "SELECT id, queue, name, backend, payload, dedupe_key, priority, run_at, status, attempt,"
        " max_attempts, enqueued_at, pushes FROM {j} WHERE pending_key = %s"
    ),
    # The ids of jobs just written in this transaction. Completed with their keys.
    "ids_by_key": "SELECT pending_key, id FROM {j} WHERE pending_key IN (",
    # Move a waiting job (dedupe when its queue is full). params: delay (or run time),
    # priority, pending key
    "move_waiting_after": "UPDATE {j} SET run_at = {later}, priority = %s, pushes = pushes + 1 WHERE pending_key = %s",
    "move_waiting_at": "UPDATE {j} SET run_at = %s, priority = %s, pushes = pushes + 1 WHERE pending_key = %s",
    # -- queues and their bounds --
    # Is the queue holding at least n waiting jobs (of any pool's lane)? params: queue, n - 1
    "queue_holds": "SELECT 1 FROM {j} WHERE status = {job.ready} AND queue = %s LIMIT 1 OFFSET %s",
    # A queue's settings. params: name
    "queue_settings": "SELECT paused, max_length, when_full, full_timeout FROM {q} WHERE name = %s",
    # Every queue's (a row per queue ever pushed to: a few).
    "all_queues": "SELECT name, paused, max_length, when_full, full_timeout FROM {q}",
    # Its row, made on first push; a second maker changes nothing. params: name, paused,
    # when_full, full_timeout (the model's defaults)
    "add_queue": (
        "INSERT INTO {q} (name, paused, max_length, when_full, full_timeout) VALUES (%s, %s, NULL, %s, %s)"
        " {upsert[name]} name = {new[name]}"
    ),
    # -- claim: per queue, an index range scan of ready rows in claim order; jobs that
    # need no resource (pool '': their turn is 0), or one pool's (jobs.leasing) --
    # params: queue, pool, how many
    "due": (
        f"SELECT {_CLAIMED_COLUMNS} FROM {{j}} WHERE status = {{job.ready}} AND queue = %s AND pool = %s"
        " AND run_at <= {now} ORDER BY priority DESC, turn, run_at, id LIMIT %s{skip_locked}"
    ),
    # ... but for jobs of handlers the worker lacks and another live worker has (see
    # jobs.handoff). Completed with the names, then "due_skipping_tail". params: queue,
    # pool, names, how many
    "due_skipping": (
        f"SELECT {_CLAIMED_COLUMNS} FROM {{j}} WHERE status = {{job.ready}} AND queue = %s AND pool = %s"
        " AND run_at <= {now} AND name NOT IN ("
    ),
    "due_skipping_tail": " ORDER BY priority DESC, turn, run_at, id LIMIT %s{skip_locked}",
    # params: worker, ttl, then ids
    "claim": (
        "UPDATE {j} SET status = {job.running}, attempt = attempt + 1, claims = claims + 1, worker = %s,"
        " pending_key = NULL, started_at = {now}, expires_at = {later} WHERE status = {job.ready} AND id IN ("
    ),
    # Without SKIP LOCKED a racing claim may have won some rows. params: worker, then ids
    "claimed_among": "SELECT id FROM {j} WHERE status = {job.running} AND worker = %s AND id IN (",
    # After a claim whose reply was lost: what runs under this worker's name. Running rows
    # are few (workers x concurrency), read through the claim index's status prefix.
    # params: worker
    "running_for": f"SELECT {_CLAIMED_COLUMNS} FROM {{j}} WHERE status = {{job.running}} AND worker = %s",
    # -- outcomes: each names the claim it ends --
    # params: result, then (id, claims) pairs
    "succeed": (
        "UPDATE {j} SET status = {job.succeeded}, result = %s, finished_at = {now}, expires_at = NULL"
        " WHERE status = {job.running} AND ("
    ),
    # params: delay, id, claims
    "retry_later": (
        "UPDATE {j} SET status = {job.ready}, run_at = {later}, worker = '', expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # params: status (failed or dead), id, claims
    "end_unsuccessful": (
        "UPDATE {j} SET status = %s, finished_at = {now}, expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # A worker without the job's handler (a rolling deploy) gives it back for later, and
    # the try with it. params: delay, id, claims
    "give_back_unhandled": (
        "UPDATE {j} SET status = {job.ready}, run_at = {later}, attempt = CASE WHEN attempt > 0 THEN attempt - 1"
        " ELSE 0 END, worker = '', expires_at = NULL, bounced_at = COALESCE(bounced_at, {now})"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # ... or at once when a live worker has the handler, its grace restarted. params: id, claims
    "give_back_now": (
        "UPDATE {j} SET status = {job.ready}, run_at = {now}, attempt = CASE WHEN attempt > 0 THEN attempt - 1"
        " ELSE 0 END, worker = '', expires_at = NULL, bounced_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # A worker that starts with the handler of jobs given back for later takes them now.
    # Completed with ids (then, but for "*", "take_over_queues" and the queues).
    "take_over": (
        "UPDATE {j} SET run_at = {now}, bounced_at = NULL WHERE status = {job.ready} AND bounced_at IS NOT NULL"
        " AND id IN ("
    ),
    "take_over_queues": " AND queue IN (",
    # A target refused the job's resource: back now, the try given back; the next claim
    # pairs it with another resource (this one is banned for its target). params: id, claims
    "give_back_banned": (
        "UPDATE {j} SET status = {job.ready}, run_at = {now}, attempt = CASE WHEN attempt > 0 THEN attempt - 1"
        " ELSE 0 END, worker = '', expires_at = NULL WHERE id = %s AND claims = %s AND status = {job.running}"
    ),
    # ... unless no worker has had the handler for the grace period. params: id, claims, -grace
    "fail_unhandled": (
        "UPDATE {j} SET status = {job.failed}, finished_at = {now}, expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running} AND bounced_at <= {later}"
    ),
    # params: job id, attempt (the try's number), exception, message, traceback, worker
    "record_error": (
        "INSERT INTO {e} (job_id, attempt, exception, message, traceback, worker, at)"
        " VALUES (%s, %s, %s, %s, %s, %s, {now})"
    ),
    # A worker that shuts down hands back every attempt still running under its name (the
    # unfinished, and any whose claim reply was lost); an interrupted attempt does not use
    # up a try. Completed with "AND id NOT IN (...)" for outcomes not yet written.
    # params: worker
    "hand_back": (
        "UPDATE {j} SET status = {job.ready}, worker = '', expires_at = NULL,"
        " attempt = CASE WHEN attempt > 0 THEN attempt - 1 ELSE 0 END WHERE status = {job.running} AND worker = %s"
    ),
    # The limited keys of what it hands back (their slots come free). params: worker
    "hand_back_keys": (
        "SELECT limit_key, concurrency, rate FROM {j} WHERE status = {job.running} AND worker = %s"
        " AND limit_key <> ''"
    ),
    # -- recovery: leases on running attempts --
    # The heartbeat extends the leases of the attempts the worker runs (or finished and has
    # yet to write), and no other: a claim it never heard back from lapses and is recovered.
    # params: ttl, worker, then ids
    "extend": "UPDATE {j} SET expires_at = {later} WHERE status = {job.running} AND worker = %s AND id IN (",
    # A worker whose own lease lapsed registers again and keeps the jobs nobody recovered.
    # params: new worker, old worker
    "adopt": "UPDATE {j} SET worker = %s WHERE status = {job.running} AND worker = %s",
    # Running attempts whose lease lapsed (their worker stopped heartbeating). params: how many
    "lapsed": (
        "SELECT id, claims, attempt, worker, max_attempts, queue, on_finish, limit_key, concurrency, rate, name"
        " FROM {j} WHERE status = {job.running} AND expires_at <= {now} ORDER BY id LIMIT %s{skip_locked}"
    ),
    # ... of these jobs only (an operator's choice). params: ids
    "lapsed_among": (
        "SELECT id, claims, attempt, worker, max_attempts, queue, on_finish, limit_key, concurrency, rate, name"
        " FROM {j} WHERE status = {job.running} AND expires_at <= {now} AND id IN ("
    ),
    # Back to ready when attempts remain, else dead. params: id, claims
    "recover": (
        "UPDATE {j} SET status = CASE WHEN attempt >= max_attempts THEN {job.dead} ELSE {job.ready} END,"
        " finished_at = CASE WHEN attempt >= max_attempts THEN {now} ELSE NULL END,"
        " worker = '', expires_at = NULL"
        " WHERE id = %s AND claims = %s AND status = {job.running} AND expires_at <= {now}"
    ),
    # -- operators' actions. params: ids --
    # Waiting jobs to cancel, locked first so their on_finish jobs are queued for exactly
    # the rows cancelled.
    "cancellable": "SELECT id, queue, on_finish FROM {j} WHERE status IN ({job.ready}, {job.blocked}) AND id IN (",
    "cancel": (
        "UPDATE {j} SET status = {job.cancelled}, pending_key = NULL, finished_at = {now}"
        " WHERE status IN ({job.ready}, {job.blocked}) AND id IN ("
    ),
    # A finished job that did not succeed runs again now with the tries it has left, and
    # at least one: max_attempts grows only when it was used up.
    "run_again": (
        "UPDATE {j} SET status = {job.ready}, run_at = {now}, max_attempts = CASE WHEN max_attempts > attempt"
        " THEN max_attempts ELSE attempt + 1 END, finished_at = NULL, worker = '', result = NULL,"
        " bounced_at = NULL WHERE status IN ({job.failed}, {job.dead}, {job.cancelled}) AND id IN ("
    ),
    "discardable": "SELECT id, status, queue, on_finish FROM {j} WHERE status <> {job.running} AND id IN (",
    "discard": "DELETE FROM {j} WHERE status <> {job.running} AND id IN (",
    # -- history --
    # Finished runs of one key beyond the newest n. params: key, n
    "old_runs_of_key": (
        "SELECT id FROM {j} WHERE dedupe_key = %s AND finished_at IS NOT NULL"
        " ORDER BY finished_at DESC, id DESC LIMIT 1000 OFFSET %s"
    ),
    # Which of these keys have more than n finished runs? Completed with the keys, then
    # "keys_over_tail" (param n).
    "keys_over": "SELECT dedupe_key FROM {j} WHERE finished_at IS NOT NULL AND dedupe_key IN (",
    "keys_over_tail": " GROUP BY dedupe_key HAVING COUNT(*) > %s",
    # params: cutoff, batch size
    "finished_before": "SELECT id FROM {j} WHERE finished_at < %s ORDER BY finished_at LIMIT %s",
    "delete_errors": "DELETE FROM {e} WHERE job_id IN (",
    "delete_finished": "DELETE FROM {j} WHERE finished_at IS NOT NULL AND id IN (",
}

# A worker process's row is a lease, with the protocol of leases.sql's (kind "worker").
WORKERS = {
    # params: name, holder, queues, concurrency, handlers, ttl
    "register": (
        "INSERT INTO {w} (name, holder, token, queues, concurrency, handlers, handed_back, started_at,"
        " heartbeat_at, expires_at) VALUES (%s, %s, 1, %s, %s, %s, '', {now}, {now}, {later})"
    ),
    "registered": "SELECT id, {now} FROM {w} WHERE name = %s",
    # params: ttl, id, token, holder
    "renew": (
        "UPDATE {w} SET expires_at = {later}, heartbeat_at = {now}"
        " WHERE id = %s AND token = %s AND holder = %s AND expires_at > {now}"
    ),
    # params: id, token, holder
    "release": "UPDATE {w} SET expires_at = {now}, holder = '' WHERE id = %s AND token = %s AND holder = %s",
    # Who runs what: the live workers' queues and handlers (a row per live process).
    "live_handlers": "SELECT name, queues, handlers FROM {w} WHERE expires_at > {now}",
    # Jobs workers handed back while no live worker had their handler.
    "handed_back": "SELECT handed_back FROM {w} WHERE handed_back <> ''",
    # params: handed back (JSON), name
    "note_handed_back": "UPDATE {w} SET handed_back = %s WHERE name = %s",
    # Rows of workers gone for a while are forgotten. params: -seconds
    "forget": "DELETE FROM {w} WHERE expires_at < {later}",
}

# Per-key limits (see leases.tasks.jobs.limits), in the claim's and the outcomes' transactions.
LIMITS = {
    # The rows whose locks serialise decisions about keys. Each decision writes its keys'
    # rows (a counter), not only locks them: on Galera a row lock is local to its node and
    # only written rows are certified, so two nodes deciding about one key must both write
    # it for one of them to be refused at COMMIT (and retried). The range read over the
    # unique index locks in name order everywhere: no deadlock. Completed with the keys.
    "lock_keys": "UPDATE {k} SET decisions = decisions + 1 WHERE name IN (",
    # Which of the keys have a row (after "lock_keys", which locked them). Completed with keys.
    "existing_keys": "SELECT name FROM {k} WHERE name IN (",
    # The keys without a row yet: completed with "(%s, 1)" per key, then "add_keys_tail".
    "add_keys": "INSERT INTO {k} (name, decisions) VALUES ",
    "add_keys_tail": " {upsert[name]} decisions = {k}.decisions + 1",
    # Running jobs per key, through (limit_key, status). Completed with keys, "by_key".
    "running_per_key": "SELECT limit_key, COUNT(*) FROM {j} WHERE status = {job.running} AND limit_key IN (",
    # Starts per key since a moment, and the oldest. params: since, then the keys, "by_key"
    "starts_per_key": (
        "SELECT limit_key, COUNT(*), MIN(started_at) FROM {j} WHERE started_at > %s AND limit_key IN ("
    ),
    # Which of these keys hold blocked jobs. Completed with keys, "by_key".
    "blocked_per_key": "SELECT limit_key, COUNT(*) FROM {j} WHERE status = {job.blocked} AND limit_key IN (",
    "by_key": " GROUP BY limit_key",
    # Under a key's lock no statement waits for a job row (a claim holds the rows it
    # picked, SKIP LOCKED, while it waits for the key: waiting for them back would be a
    # deadlock). So what a decision holds back is read first, skipping rows another
    # transaction holds (a claim that decides about them once it has the key), then
    # written by id. The key's ready jobs in claim order. params: key, how many
    "holdable": (
        "SELECT id FROM {j} WHERE limit_key = %s AND status = {job.ready} ORDER BY priority DESC, run_at, id"
        " LIMIT %s{skip_locked}"
    ),
    # They leave the claim (concurrency). Completed with ids.
    "block": "UPDATE {j} SET status = {job.blocked} WHERE status = {job.ready} AND id IN (",
    # ... or wait, ready, until the window has room (rate). params: run time, run time, then ids
    "delay": "UPDATE {j} SET run_at = %s WHERE status = {job.ready} AND run_at < %s AND id IN (",
    # The key's blocked jobs in claim order, but those another transaction holds (a
    # cancel, a merging push): the periodic pass unblocks them later. params: key, how many
    "next_blocked": (
        "SELECT id FROM {j} WHERE limit_key = %s AND status = {job.blocked} ORDER BY priority DESC, run_at, id"
        " LIMIT %s{skip_locked}"
    ),
    "unblock": "UPDATE {j} SET status = {job.ready} WHERE status = {job.blocked} AND id IN (",
    # Keys with blocked jobs, and how many. (A pass over blocked rows only.)
    "blocked_keys": "SELECT limit_key, COUNT(*) FROM {j} WHERE status = {job.blocked} GROUP BY limit_key",
    # What a key holds back: its limits as its newest waiting job carries them. params: key
    "limits_carried": (
        "SELECT concurrency, rate FROM {j} WHERE limit_key = %s AND status IN ({job.ready}, {job.blocked})"
        " ORDER BY id DESC LIMIT 1"
    ),
}

#: A resource row's target (the parameter) does not refuse it now (leases.targets).
_USABLE_FOR = USABLE_FOR.replace("{t}", "{r}")

# Jobs that hold resources (see leases.tasks.jobs.leasing): the claim of a pool's jobs
# with their leases, their renewal and release, affinities and turns. The resources'
# own statements (claim, release) are the base app's ("resource" kind).
LEASING = {
    # Whether the pool has a free slot at all. params: pool
    "any_free": "SELECT 1 FROM {r} WHERE pool = %s AND busy_before <= {now} LIMIT 1",
    # The pool's free slots a target does not refuse now (banned, rested or paced: each
    # a probe of the unique (pool, target, name) index), longest free first, locked: an
    # index range read of (pool, busy_before). params: pool, target, how many
    "free_for": (
        "SELECT id, token, name, slot, data FROM {r} WHERE pool = %s AND busy_before <= {now}" + _USABLE_FOR
        + " ORDER BY busy_before, id LIMIT %s{skip_locked}"
    ),
    # ... of one resource (an affinity key's). params: pool, target, name
    "free_named": (
        "SELECT id, token, name, slot, data FROM {r} WHERE pool = %s AND busy_before <= {now}" + _USABLE_FOR
        + " AND name = %s ORDER BY slot{skip_locked}"
    ),
    # Which of these resources exist unquarantined (held ones too). params: pool, then names
    "usable_named": (
        "SELECT DISTINCT name FROM {r} WHERE pool = %s AND (quarantined_until IS NULL OR quarantined_until <= {now})"
        " AND name IN ("
    ),
    # A resource by id (a lease read back after a lost reply). params: id
    "resource": "SELECT name, slot, data FROM {r} WHERE id = %s",
    # Lease the paired slots, each under its job's holder, in one statement (the rows are
    # locked by the claim; the token grows): "take" + one " WHEN %s THEN %s" (slot id,
    # holder) per slot + "take_tail" + the ids. params: ttl, the pairs, then ids
    "take": "UPDATE {r} SET busy_before = {later}, holder = CASE id",
    "take_tail": (
        " END, token = token + 1, acquired_at = {now}, renewed_at = {now}, quarantined_until = NULL,"
        " quarantine_reason = '' WHERE busy_before <= {now} AND id IN ("
    ),
    # The claim of jobs with their leases: "claim_leased" + " WHEN %s THEN %s" (job id,
    # resource id) per job + "claim_leased_middle" + the same (job id, token) +
    # "claim_leased_tail" + the ids. params: worker, ttl, the pairs, the pairs, then ids
    "claim_leased": (
        "UPDATE {j} SET status = {job.running}, attempt = attempt + 1, claims = claims + 1, worker = %s,"
        " pending_key = NULL, started_at = {now}, expires_at = {later}, resource_id = CASE id"
    ),
    "claim_leased_middle": " END, lease_token = CASE id",
    "claim_leased_tail": " END WHERE status = {job.ready} AND id IN (",
    # Release the slots of ended attempts, each only while its lease holds it: completed
    # as "renew" is. params: cool-down, ...
    "release": "UPDATE {r} SET busy_before = {later}, holder = '' WHERE (",
    # Which resource each affinity key's jobs last used. params: pool, then keys
    "bound": "SELECT affinity, name FROM {a} WHERE pool = %s AND affinity IN (",
    # params: pool, key, name
    "bind": (
        "INSERT INTO {a} (pool, affinity, name, updated_at) VALUES (%s, %s, %s, {now})"
        " {upsert[pool, affinity]} name = {new[name]}, updated_at = {new[updated_at]}"
    ),
    # The heartbeat renews the leases of a worker's jobs: completed with one
    # "(id = %s AND token = %s AND holder = %s)" per lease, OR'd, and ")". params: ttl, ...
    "renew": "UPDATE {r} SET busy_before = {later}, renewed_at = {now} WHERE busy_before > {now} AND (",
    # ... and which of them it still holds. Completed the same way.
    "held": "SELECT id FROM {r} WHERE busy_before > {now} AND (",
    # The leases of the attempts a worker hands back. params: worker
    "leases_of": (
        "SELECT resource_id, lease_token, id FROM {j} WHERE status = {job.running} AND worker = %s"
        " AND resource_id IS NOT NULL"
    ),
    # A lane's current turn: its first job's in claim order. params: queue, pool
    "frontier": (
        "SELECT turn FROM {j} WHERE status = {job.ready} AND queue = %s AND pool = %s"
        " ORDER BY priority DESC, turn, run_at, id LIMIT 1"
    ),
    # params: pool, queue, then targets
    "last_turns": "SELECT target, last_turn FROM {p} WHERE pool = %s AND queue = %s AND target IN (",
    # params: pool, queue, target, turn
    "set_turn": (
        "INSERT INTO {p} (pool, queue, target, last_turn) VALUES (%s, %s, %s, %s) {upsert[pool, queue, target]}"
        " last_turn = CASE WHEN {p}.last_turn > {new[last_turn]} THEN {p}.last_turn ELSE {new[last_turn]} END"
    ),
    # Jobs due and waiting for each pool (a read of the ready rows of the claim index).
    "due_per_pool": (
        "SELECT pool, COUNT(*) FROM {j} WHERE status = {job.ready} AND pool <> '' AND run_at <= {now}"
        " GROUP BY pool"
    ),
}

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

# The pool/bucket dispatcher (see leases.tasks.dispatcher).
DISPATCH = {
    "touch_worker": "UPDATE {w} SET last_seen = {now} WHERE dispatcher = %s AND name = %s",
    "add_worker": "INSERT INTO {w} (dispatcher, name, last_seen) VALUES (%s, %s, {now})",
    "bucket": (
        "SELECT id, value FROM {t} WHERE dispatcher = %s AND worker = %s AND state = {task.bucket}"
        " ORDER BY assigned_at, score, id"
    ),
    "lowest_in_pool": (
        "SELECT id, value FROM {t} WHERE dispatcher = %s AND state = {task.pool}"
        " ORDER BY score, id LIMIT %s{skip_locked}"
    ),
    # params: worker, then ids
    "to_bucket": (
        "UPDATE {t} SET state = {task.bucket}, worker = %s, assigned_at = {now} WHERE state = {task.pool} AND id IN ("
    ),
    "back_to_pool": (
        "UPDATE {t} SET state = {task.pool}, worker = NULL, assigned_at = NULL"
        " WHERE worker = %s AND state = {task.bucket} AND id IN ("
    ),
    "done": (
        "UPDATE {t} SET state = {task.done}, done_at = {now}"
        " WHERE dispatcher = %s AND worker = %s AND state = {task.bucket}"
    ),
    # Buckets of workers not seen since `later` (a negative offset) go back to the pool.
    "reclaim": (
        "UPDATE {t} SET state = {task.pool}, worker = NULL, assigned_at = NULL"
        " WHERE dispatcher = %s AND state = {task.bucket} AND worker NOT IN"
        " (SELECT name FROM {w} WHERE dispatcher = %s AND last_seen >= {later})"
    ),
    "forget_workers": "DELETE FROM {w} WHERE dispatcher = %s AND last_seen < {later}",
    "start_rebuild": "UPDATE {p} SET generation = generation + 1, rebuild_started_at = {now} WHERE name = %s",
    "rebuild_started": "SELECT generation, rebuild_started_at FROM {p} WHERE name = %s",
    # Completed with "(%s, %s, %s, {task.pool}, %s)" per task ("upsert_row"), then "upsert_tail".
    "upsert": "INSERT INTO {t} (dispatcher, value, score, state, seen) VALUES ",
    "upsert_row": "(%s, %s, %s, {task.pool}, %s)",
    # A task in a bucket stays there, and so does one done during this rebuild; a pool
    # task takes the new score; a task done before the rebuild began is listed again.
    # (MySQL applies these left to right; each reads only columns not yet assigned. The
    # row's columns are named with the table's: PostgreSQL's update part sees two rows.)
    # params: rebuild start, rebuild start, rebuild start, generation
    "upsert_tail": (
        " {upsert[dispatcher, value]}"
        " score = CASE WHEN {t}.state = {task.pool} OR ({t}.state = {task.done} AND {t}.done_at < %s)"
        " THEN {new[score]} ELSE {t}.score END,"
        " worker = CASE WHEN {t}.state = {task.done} AND {t}.done_at < %s THEN NULL ELSE {t}.worker END,"
        " state = CASE WHEN {t}.state = {task.done} AND {t}.done_at < %s THEN {task.pool} ELSE {t}.state END,"
        " seen = %s"
    ),
    "unlisted": "SELECT id FROM {t} WHERE dispatcher = %s AND state = {task.pool} AND seen <> %s LIMIT %s",
    "old_done": "SELECT id FROM {t} WHERE dispatcher = %s AND state = {task.done} AND done_at < %s LIMIT %s",
    # params: state, then ids
    "delete": "DELETE FROM {t} WHERE state = %s AND id IN (",
    "rebuilt": "UPDATE {p} SET rebuilt_at = {now} WHERE name = %s",
    "counts": "SELECT state, COUNT(*) FROM {t} WHERE dispatcher = %s GROUP BY state",
}

# What the operators' dashboard reads of the jobs (see leases.tasks.readings).
# The jobs in reach of a window, each with when it joined the queue and when it left it
# (NULL while it waits): its last start, or its end if it never ran.
_WAITS = (
    "SELECT queue, enqueued_at AS entered, CASE WHEN status IN ({job.ready}, {job.blocked}) THEN NULL"
    " ELSE COALESCE(started_at, finished_at) END AS gone FROM {j}"
)
READINGS = {
    # Jobs that finished in each bar of a window, through the finished_at index (a closed
    # range, which SQLite's planner takes), but for the names the caller lists: "IN (" is
    # completed by a placeholder per name (sql.in_list), then "finished_per_bar_tail".
    # params: start, step, start, end, the names
    "finished_per_bar": (
        "SELECT queue, status, {steps[finished_at]} AS bar, COUNT(*) FROM {j}"
        " WHERE finished_at BETWEEN %s AND %s AND name NOT IN ("
    ),
    "finished_per_bar_tail": " GROUP BY queue, status, bar",
    # The peak of jobs waiting within each bar of a window, per queue, and the change over
    # the bar. The jobs in reach (unfinished ones through the claim index, those that
    # ended within the window through finished_at) become moves: +1 when one joined (the
    # ones that joined before the window count at its start, in its first bar), -1 when
    # it left within the window; a running sum over each queue's moves is the number
    # waiting after each, a leaving counted before a joining at the same instant. The
    # rows read back are one per queue and bar, however many jobs moved.
    # params: start, end, start, start, start, start, step
    "waiting_per_bar": (
        "WITH waits AS (" + _WAITS + " WHERE status IN ({job.ready}, {job.blocked}, {job.running})"
        " UNION ALL " + _WAITS + " WHERE finished_at BETWEEN %s AND %s),"
        " moves AS (SELECT queue, entered AS moved_at, 1 AS delta FROM waits"
        " WHERE gone IS NULL OR (gone > entered AND gone > %s)"
        " UNION ALL SELECT queue, gone, -1 FROM waits WHERE gone > entered AND gone > %s)"
        " SELECT queue, bar, MAX(waiting), SUM(delta) FROM (SELECT queue, delta,"
        " CASE WHEN moved_at < %s THEN 0 ELSE {steps[moved_at]} END AS bar,"
        " SUM(delta) OVER (PARTITION BY queue ORDER BY moved_at, delta) AS waiting FROM moves) AS counted"
        " GROUP BY queue, bar"
    ),
}

_JOB = "leases_tasks.Job"
register("job", JOBS, {"j": _JOB, "e": "leases_tasks.JobError", "q": "leases_tasks.Queue"}, {"job": JobStatus})
register("worker", WORKERS, {"w": "leases_tasks.Worker"})
register("limits", LIMITS, {"k": "leases_tasks.LimitKey", "j": _JOB}, {"job": JobStatus})
register("schedule", SCHEDULES, {"r": "leases_tasks.ScheduleRun", "s": "leases_tasks.Schedule", "j": _JOB},
         {"job": JobStatus, "run": RunStatus})
register("readings", READINGS, {"j": _JOB}, {"job": JobStatus})
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


def leasing(connection: Any) -> SimpleNamespace:
    return statements(connection, "leasing")


def dispatch(connection: Any) -> SimpleNamespace:
    return statements(connection, "dispatch")
