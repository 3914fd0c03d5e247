"""Statements of the pool/bucket dispatcher (leases.tasks.dispatcher)."""
from __future__ import annotations

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
