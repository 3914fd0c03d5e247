"""The job queue's statements: jobs, worker processes' rows, per-key limits."""
from __future__ import annotations

_CLAIMED_COLUMNS = (
    "id, priority, run_at, queue, name, backend, payload, attempt, max_attempts, dedupe_key, claims, on_finish,"
    " limit_key, concurrency, rate, traceparent, pool, target, affinity, turn, resource_id, lease_token"
)

#: A pushed job as the database holds it (see jobs.push._as_job).
_PUSHED_COLUMNS = (
    "id, queue, name, backend, payload, dedupe_key, pending_key, priority, run_at, status, attempt, max_attempts,"
    " enqueued_at, pushes"
)

JOBS = {
    # -- push: one row per job, a VALUES group per job ("values_after" or "values_at") --
    "insert": (
        "INSERT INTO {j} (queue, name, backend, on_finish, payload, dedupe_key, pending_key, priority,"
        " limit_key, concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, push_id, run_at,"
        " status, attempt, claims, pushes, worker, enqueued_at) VALUES "
    ),
    # params: queue, name, backend, on_finish, payload, key, key, priority, limit key,
    # concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, push id,
    # then the delay ("after") or the run time ("at")
    "values_after": (
        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {later}, {job.ready}, 0, 0, 1,"
        " '', {now})"
    ),
    "values_at": (
        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {job.ready}, 0, 0, 1, '',"
        " {now})"
    ),
    # PostgreSQL's push (its dialect's `arrays`): one array per column, so the statement's
    # text is the same for any number of jobs and is parsed once by the driver and the
    # server (1,000 rows of 14 placeholders cost psycopg more to parse than the server to
    # write). params: the push id, then one list each: queue, name, backend, on_finish,
    # payload, key, priority, limit key, concurrency, rate, max_attempts, traceparent, pool,
    # target, affinity, turn, run time (None: after the delay), delay in microseconds
    "insert_arrays": (
        "INSERT INTO {j} (queue, name, backend, on_finish, payload, dedupe_key, pending_key, priority,"
        " limit_key, concurrency, rate, max_attempts, traceparent, pool, target, affinity, turn, push_id, run_at,"
        " status, attempt, claims, pushes, worker, enqueued_at) SELECT q, n, b, f, p, k, k, pr, lk, c, r, ma, tp,"
        " po, ta, af, tu, %s::bigint, COALESCE(t.at, {now} + t.delay * INTERVAL '1 microsecond'), {job.ready}, 0,"
        " 0, 1, '', {now}"
        " FROM unnest(%s::varchar[], %s::varchar[], %s::varchar[], %s::varchar[], %s::jsonb[], %s::varchar[],"
        " %s::smallint[], %s::varchar[], %s::int[], %s::varchar[], %s::int[], %s::varchar[], %s::varchar[],"
        " %s::varchar[], %s::varchar[], %s::bigint[], %s::timestamptz[], %s::bigint[])"
        " AS t(q, n, b, f, p, k, pr, lk, c, r, ma, tp, po, ta, af, tu, at, delay)"
    ),
    # A waiting job with the same key takes the new run time and priority (the latest
    # push says what is wanted now), keeps its name and payload, and counts the push,
    # whose id it keeps until the next merge.
    "merge_waiting": (
        " {upsert[pending_key]} run_at = {new[run_at]}, priority = {new[priority]}, pushes = {j}.pushes + 1,"
        " merged_push_id = {new[push_id]}"
    ),
    # params: pending key -> the job as the database holds it after the push
    "waiting_by_key": f"SELECT {_PUSHED_COLUMNS} FROM {{j}} WHERE pending_key = %s",
    # After a push whose reply was lost: the row it wrote or merged into, if it did, in
    # whatever state it is now; a range read of the key's rows (the dedupe key index:
    # its waiting job, those running, and the finished runs it keeps). params: key, push
    # id, push id
    "pushed_by": (
        f"SELECT {_PUSHED_COLUMNS} FROM {{j}} WHERE dedupe_key = %s AND (push_id = %s OR merged_push_id = %s)"
    ),
    # ... and after a batch's: whether any row of its keys has its id. params: push id, push
    # id, then the keys, then "pushed_among_tail"
    "pushed_among": "SELECT id FROM {j} WHERE (push_id = %s OR merged_push_id = %s) AND dedupe_key IN (",
    "pushed_among_tail": " LIMIT 1",
    # Ends a push's upsert where an INSERT returns columns (PostgreSQL, MariaDB, SQLite
    # 3.35+): the row it leaves, new or merged, with no read-back.
    "returning_pushed": f" RETURNING {_PUSHED_COLUMNS}",
    # ... and on PostgreSQL (its dialect's `notify`) it also wakes the listeners of the
    # row's queue when it commits, as `announce` does. params: the channel
    "returning_pushed_notify": f" RETURNING {_PUSHED_COLUMNS}, pg_notify(%s, queue)",
    # The ids of jobs just written in this transaction. Completed with their keys.
    "ids_by_key": "SELECT pending_key, id FROM {j} WHERE pending_key IN (",
    # ... or returned by the upsert itself, where an INSERT returns columns.
    "returning_ids": " RETURNING pending_key, id",
    # Move a waiting job (dedupe when its queue is full), as a merge does. params: delay
    # (or run time), priority, push id, pending key
    "move_waiting_after": (
        "UPDATE {j} SET run_at = {later}, priority = %s, pushes = pushes + 1, merged_push_id = %s"
        " WHERE pending_key = %s"
    ),
    "move_waiting_at": (
        "UPDATE {j} SET run_at = %s, priority = %s, pushes = pushes + 1, merged_push_id = %s WHERE pending_key = %s"
    ),
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
    # params: claims' fence floor, worker, ttl, then ids
    "claim": (
        "UPDATE {j} SET status = {job.running}, attempt = attempt + 1, claims = {fence[claims]}, worker = %s,"
        " pending_key = NULL, waiting_for = '', started_at = {now}, expires_at = {later} WHERE status = {job.ready} AND id IN ("
    ),
    # Without SKIP LOCKED a racing claim may have won some rows. params: worker, then ids
    "claimed_among": "SELECT id FROM {j} WHERE status = {job.running} AND worker = %s AND id IN (",
    # After a claim whose reply was lost: what runs under this worker's name. Running rows
    # are few (workers x concurrency), read through the claim index's status prefix.
    # params: worker
    "running_for": f"SELECT {_CLAIMED_COLUMNS} FROM {{j}} WHERE status = {{job.running}} AND worker = %s",
    # -- outcomes: each names the claim it ends --
    # Which of these attempts still run, locked: the ones a batch of successes with a
    # follow-up ends. Completed with (id, claims) pairs and the dialect's FOR UPDATE.
    "still_running": "SELECT id FROM {j} WHERE status = {job.running} AND (",
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
    # at least one: max_attempts grows only when it was used up; a cancel asked of its
    # last attempt is forgotten (else the new attempt would stop at its first heartbeat).
    "run_again": (
        "UPDATE {j} SET status = {job.ready}, run_at = {now}, max_attempts = CASE WHEN max_attempts > attempt"
        " THEN max_attempts ELSE attempt + 1 END, finished_at = NULL, worker = '', result = NULL,"
        " bounced_at = NULL, cancel_requested_at = NULL"
        " WHERE status IN ({job.failed}, {job.dead}, {job.cancelled}) AND id IN ("
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
