"""Statements of jobs that hold resources (leases.tasks.jobs.leasing)."""
from __future__ import annotations

from leases.sql import USABLE_FOR

#: A resource row's target (the parameter) does not refuse it now (leases.targets).
_USABLE_FOR = USABLE_FOR.replace("{t}", "{r}")

# Jobs that hold resources (see leases.tasks.jobs.leasing): the claim of a pool's jobs
# with their leases, their renewal and release, affinities and turns. The resources'
# own statements (claim, release) are the base app's ("resource" kind).
LEASING = {
    # Whether the pool has a free slot at all. params: pool
    "any_free": "SELECT 1 FROM {r} WHERE pool = %s AND busy_before <= {now} LIMIT 1",
    # The pool's longest free slots, locked: an index range read of (pool, busy_before, id),
    # in its order. params: pool, how many
    "free": (
        "SELECT id, token, name, slot, data FROM {r} WHERE pool = %s AND busy_before <= {now}"
        " ORDER BY busy_before, id LIMIT %s{skip_locked}"
    ),
    # Which of these resources these targets refuse now (banned, rested or paced): index
    # reads of a few rows, by (pool, target, name) or (pool, name). Completed with the
    # targets, " AND name IN (", and the names. params: pool, then targets, then names
    "refused": (
        "SELECT name, target FROM {g} WHERE pool = %s"
        " AND (banned_until > {now} OR rested_until > {now} OR next_start_at > {now}) AND target IN ("
    ),
    # The pool's free slots a target does not refuse now (banned, rested or paced: each
    # a probe of the unique (pool, target, name) index), longest free first, locked: an
    # index range read of (pool, busy_before, id). params: pool, pool, target, how many
    "free_for": (
        "SELECT id, token, name, slot, data FROM {r} WHERE pool = %s AND busy_before <= {now}" + _USABLE_FOR
        + " ORDER BY busy_before, id LIMIT %s{skip_locked}"
    ),
    # ... of one resource (an affinity key's). params: pool, pool, target, name
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
    # holder) per slot + "take_tail" + the ids. params: ttl, the pairs, the fence floor, then ids
    "take": "UPDATE {r} SET busy_before = {later}, holder = CASE id",
    "take_tail": (
        " END, token = {fence[token]}, acquired_at = {now}, renewed_at = {now}, quarantined_until = NULL,"
        " quarantine_reason = '' WHERE busy_before <= {now} AND id IN ("
    ),
    # The claim of jobs with their leases: "claim_leased" + " WHEN %s THEN %s" (job id,
    # resource id) per job + "claim_leased_middle" + the same (job id, token) +
    # "claim_leased_tail" + the ids. params: claims' fence floor, worker, ttl, the pairs,
    # the pairs, then ids
    "claim_leased": (
        "UPDATE {j} SET status = {job.running}, attempt = attempt + 1, claims = {fence[claims]}, worker = %s,"
        " pending_key = NULL, waiting_for = '', started_at = {now}, expires_at = {later}, resource_id = CASE id"
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
    # Jobs due and waiting for a resource, by pool, target and handler (a read of the
    # ready rows of the claim index).
    "due_per_target": (
        "SELECT pool, target, name, backend, COUNT(*) FROM {j} WHERE status = {job.ready} AND pool <> ''"
        " AND run_at <= {now} GROUP BY pool, target, name, backend"
    ),
}
