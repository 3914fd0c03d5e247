"""The lease protocol, as the SQL statements it runs.

Each race is decided by one conditional UPDATE and its row count. Acquire compares the
fencing token it read (never a timestamp, so two acquisitions in one clock tick cannot
be confused); renew and release match the token and the holder; every successful
statement changes at least one column, so row counts mean the same on every driver.
Values are always parameters; only the table name and the dialect's clock fragments are
put into the text.
"""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from . import db
from .choices import VerdictKind

#: A resource row ({t}) that its target does not refuse now: no ban, rest or pace of
#: leases.targets, a probe of the unique (pool, target, name) index. params: the pool
#: (again: MariaDB turns the NOT EXISTS into an IN it materializes, and without the pool
#: as a constant that read every refusal of every pool), the target.
USABLE_FOR = (
    " AND NOT EXISTS (SELECT 1 FROM {g} g WHERE g.pool = %s AND g.target = %s AND g.name = {t}.name"
    " AND (g.banned_until > {now} OR g.rested_until > {now} OR g.next_start_at > {now}))"
)

RESOURCE = {
    # Free candidates: the few that came free longest ago, an index range read of
    # (pool, busy_before) however large the pool; the caller tries them in random order so
    # a crowd of acquirers spreads over them. The fifth column is the server clock, the
    # anchor for the client's expiry estimate.
    "candidates": (
        "SELECT id, token, name, data, {now}, slot FROM {t}"
        " WHERE pool = %s AND busy_before <= {now} ORDER BY busy_before LIMIT %s"
    ),
    # ... but those a target refuses now. params: pool, pool, target, how many
    "candidates_for": (
        "SELECT id, token, name, data, {now}, slot FROM {t} WHERE pool = %s AND busy_before <= {now}" + USABLE_FOR
        + " ORDER BY busy_before LIMIT %s"
    ),
    # params: ttl, holder, fence floor, id, token read by "candidates"
    "claim": (
        "UPDATE {t} SET busy_before = {later}, holder = %s, token = {fence[token]},"
        " acquired_at = {now}, renewed_at = {now}, quarantined_until = NULL,"
        " quarantine_reason = ''"
        " WHERE id = %s AND token = %s AND busy_before <= {now}"
    ),
    # After a dropped connection: did our claim commit, and with which token? A later
    # token under our holder is ours: we claim one resource once at a time.
    # params: id, token read by "candidates", holder
    "claimed": "SELECT token FROM {t} WHERE id = %s AND token > %s AND holder = %s",
    # Renewing after expiry fails, so there is no instant with two successful holders.
    # params: ttl, id, token, holder
    "renew": (
        "UPDATE {t} SET busy_before = {later}, renewed_at = {now}"
        " WHERE id = %s AND token = %s AND holder = %s AND busy_before > {now}"
    ),
    # The slot rests `cooldown` seconds (0: free now) before it is handed out again.
    # params: cooldown, id, token, holder
    "release": (
        "UPDATE {t} SET busy_before = {later}, holder = ''"
        " WHERE id = %s AND token = %s AND holder = %s"
    ),
    # An operator frees a held resource; the token grows so the old holder's renew fails.
    # params: pool, name
    "evict": (
        "UPDATE {t} SET busy_before = {now}, holder = '', token = token + 1"
        " WHERE pool = %s AND name = %s AND busy_before > {now}"
        " AND (quarantined_until IS NULL OR quarantined_until <= {now})"
    ),
    # params: seconds, seconds, reason, pool, name
    "quarantine": (
        "UPDATE {t} SET busy_before = {later}, quarantined_until = {later},"
        " quarantine_reason = %s, holder = '', token = token + 1"
        " WHERE pool = %s AND name = %s"
    ),
    # A holder bans what it holds: only while this holding is current (its id, token and
    # holder), so a late verdict on an older holding cannot touch the next holder's.
    # params: seconds, seconds, reason, id, token, holder
    "quarantine_held": (
        "UPDATE {t} SET busy_before = {later}, quarantined_until = {later},"
        " quarantine_reason = %s, holder = '', token = token + 1"
        " WHERE id = %s AND token = %s AND holder = %s"
    ),
    # After a dropped connection: did our quarantine commit? params: id, token + 1
    "quarantined": "SELECT 1 FROM {t} WHERE id = %s AND token = %s AND quarantined_until > {now}",
    # params: pool, name
    "unquarantine": (
        "UPDATE {t} SET busy_before = {now}, quarantined_until = NULL, quarantine_reason = ''"
        " WHERE pool = %s AND name = %s AND quarantined_until IS NOT NULL"
    ),
    # Slots by state. params: pool -> total, quarantined, held, cooling
    "stats": (
        "SELECT COUNT(*),"
        " COALESCE(SUM(CASE WHEN quarantined_until > {now} THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN busy_before > {now} AND holder <> '' AND (quarantined_until IS NULL"
        " OR quarantined_until <= {now}) THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN busy_before > {now} AND holder = '' AND (quarantined_until IS NULL"
        " OR quarantined_until <= {now}) THEN 1 ELSE 0 END), 0)"
        " FROM {t} WHERE pool = %s"
    ),
    # Fair waiting: a ticket per waiter, served in id order. params: pool, holder, ttl
    "wait": "INSERT INTO {w} (pool, holder, expires_at) VALUES (%s, %s, {later})",
    "ticket": "SELECT id FROM {w} WHERE pool = %s AND holder = %s",
    # params: ttl, id
    "still_waiting": "UPDATE {w} SET expires_at = {later} WHERE id = %s",
    # The oldest live ticket of the pool, through (pool, id). params: pool
    "first_waiter": "SELECT id FROM {w} WHERE pool = %s AND expires_at > {now} ORDER BY id LIMIT 1",
    "done_waiting": "DELETE FROM {w} WHERE id = %s",
    # Tickets of waiters gone long ago. params: pool
    "lapsed_waiters": "DELETE FROM {w} WHERE pool = %s AND expires_at < {now}",
    "exists": "SELECT 1 FROM {t} WHERE pool = %s LIMIT 1",
}

# A lock is a lease on a row created on first use. The row stays when released, so its
# token keeps growing across holders.
LOCK = {
    # params: name -> id, token, holder, expired (1/0), server clock, expires_at
    "read": (
        "SELECT id, token, holder, CASE WHEN expires_at <= {now} THEN 1 ELSE 0 END, {now}, expires_at"
        " FROM {t} WHERE name = %s"
    ),
    # params: name, holder, first token, ttl; a duplicate key means someone else created it first
    "insert": (
        "INSERT INTO {t} (name, holder, token, expires_at, acquired_at)"
        " VALUES (%s, %s, %s, {later}, {now}){returning}"
    ),
    # params: holder, fence floor, ttl, id, token read by "read"
    "claim": (
        "UPDATE {t} SET holder = %s, token = {fence[token]}, expires_at = {later}, acquired_at = {now}"
        " WHERE id = %s AND token = %s AND expires_at <= {now}"
    ),
    # params: ttl, id, token, holder
    "renew": (
        "UPDATE {t} SET expires_at = {later}"
        " WHERE id = %s AND token = %s AND holder = %s AND expires_at > {now}"
    ),
    # params: id, token, holder
    "release": (
        "UPDATE {t} SET expires_at = {now}, holder = ''"
        " WHERE id = %s AND token = %s AND holder = %s"
    ),
    # An operator breaks a held lock; the token grows so the holder cannot extend it.
    # params: name
    "evict": (
        "UPDATE {t} SET expires_at = {now}, holder = '', token = token + 1"
        " WHERE name = %s AND expires_at > {now}"
    ),
}


# What targets say of resources (see leases.targets): a row per (pool, target, name),
# made by the first verdict. Each verdict moves one of its times to now + seconds.
_TARGET_UPSERT = (
    "INSERT INTO {t} (pool, target, name, {col}, ban_reason, updated_at) VALUES (%s, %s, %s, {later}, %s, {now})"
    " {upsert[pool, target, name]} {col} = {new[{col}]}, ban_reason = {reason}, updated_at = {new[updated_at]}"
)
TARGET = {
    # params: pool, target, name, seconds, reason
    "ban": _TARGET_UPSERT.replace("{col}", "banned_until").replace("{reason}", "{new[ban_reason]}"),
    # A rest keeps the reason of a ban. params: pool, target, name, seconds, ""
    "rest": _TARGET_UPSERT.replace("{col}", "rested_until").replace("{reason}", "{t}.ban_reason"),
    # params: pool, target, name, seconds between two starts, ""
    "pace": _TARGET_UPSERT.replace("{col}", "next_start_at").replace("{reason}", "{t}.ban_reason"),
    # Names a target cannot use now, and until when: through the unique index's (pool,
    # target) prefix. params: pool, target; completed with names
    "unusable": (
        "SELECT name, banned_until, rested_until, next_start_at FROM {t} WHERE pool = %s AND target = %s"
        " AND (banned_until > {now} OR rested_until > {now} OR next_start_at > {now}) AND name IN ("
    ),
    # A line of the verdict log, in the verdict's transaction.
    # params: pool, name, target, kind, reason, seconds, holder, job
    "log": (
        "INSERT INTO {v} (pool, name, target, kind, reason, until, at, holder, job)"
        " VALUES (%s, %s, %s, %s, %s, {later}, {now}, %s, %s)"
    ),
    # The last line of a resource's log for a target: a read of the (pool, name, at) index.
    # params: pool, name, target
    "last_said": (
        "SELECT kind, holder FROM {v} WHERE pool = %s AND name = %s AND target = %s ORDER BY at DESC, id DESC LIMIT 1"
    ),
    # The bans and rests in force of one resource, of one target's resources, or of one
    # target on one resource ("" for any), locked in id order before a lift: a read of the
    # (pool, name) index or of the unique (pool, target, name) one.
    # params: pool, name twice, target twice
    "in_force": (
        "SELECT id, name, target FROM {t} WHERE pool = %s AND (name = %s OR %s = '') AND (target = %s OR %s = '')"
        " AND (banned_until > {now} OR rested_until > {now}) ORDER BY id{for_update}"
    ),
    # A lift ends a ban and a rest (not the pace) of the rows "in_force" locked; completed
    # with their ids.
    "lift": (
        "UPDATE {t} SET banned_until = NULL, ban_reason = '', rested_until = NULL, updated_at = {now}"
        " WHERE (banned_until > {now} OR rested_until > {now}) AND id IN ("
    ),
    # params: pool, name, target, reason, holder
    "log_lift": (
        "INSERT INTO {v} (pool, name, target, kind, reason, until, at, holder, job)"
        " VALUES (%s, %s, %s, {kind.lift}, %s, NULL, {now}, %s, NULL)"
    ),
    # How a pool's slots stand, for operators: slots, resources, quarantined, held and
    # cooling, and when the first quarantine and cool-down end. params: pool
    "slots": (
        "SELECT COUNT(*), COUNT(DISTINCT name),"
        " COALESCE(SUM(CASE WHEN quarantined_until > {now} THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN busy_before > {now} AND holder <> '' AND (quarantined_until IS NULL"
        " OR quarantined_until <= {now}) THEN 1 ELSE 0 END), 0),"
        " COALESCE(SUM(CASE WHEN busy_before > {now} AND holder = '' AND (quarantined_until IS NULL"
        " OR quarantined_until <= {now}) THEN 1 ELSE 0 END), 0),"
        " MIN(CASE WHEN quarantined_until > {now} THEN quarantined_until END),"
        " MIN(CASE WHEN busy_before > {now} AND holder = '' AND (quarantined_until IS NULL"
        " OR quarantined_until <= {now}) THEN busy_before END)"
        " FROM {r} WHERE pool = %s"
    ),
    # The free slots a target refuses now, per resource, with why: the target's rows in
    # force (a read of the unique index's (pool, target) prefix), each joined to its free
    # slots. params: pool, target
    "refused": (
        "SELECT g.name, COUNT(r.id), g.banned_until, g.rested_until, g.next_start_at, g.ban_reason FROM {t} g"
        " JOIN {r} r ON r.pool = g.pool AND r.name = g.name AND r.busy_before <= {now}"
        " WHERE g.pool = %s AND g.target = %s"
        " AND (g.banned_until > {now} OR g.rested_until > {now} OR g.next_start_at > {now})"
        " GROUP BY g.name, g.banned_until, g.rested_until, g.next_start_at, g.ban_reason"
    ),
    # Rows all of whose times passed long ago. params: -seconds
    "forget": (
        "DELETE FROM {t} WHERE updated_at < {later} AND (banned_until IS NULL OR banned_until < {now})"
        " AND (rested_until IS NULL OR rested_until < {now}) AND (next_start_at IS NULL OR next_start_at < {now})"
    ),
    # Lines of the verdict log older than that. params: -seconds
    "forget_log": "DELETE FROM {v} WHERE at < {later}",
}


def in_list(values: Any) -> str:
    """The rest of an `IN (` clause that a statement ends with: one placeholder a value."""
    return ", ".join(["%s"] * len(values)) + ")"


def update_each(connection: BaseDatabaseWrapper, table: str, rows: dict[int, dict[str, Any]],
                fixed: dict[str, Any] | None = None) -> int:
    """One UPDATE giving each row (by id) its own values, `SET col = CASE id WHEN ... END`,
    and every row the `fixed` ones; returns the row count. Every row names the same
    columns. Far cheaper than the ORM's bulk_update, which builds the same CASE slowly."""
    if not rows:
        return 0
    ids = list(rows)
    adapt = connection.ops.adapt_datetimefield_value
    sets, params = [], []
    for column, value in (fixed or {}).items():
        sets.append(f"{connection.ops.quote_name(column)} = %s")
        params.append(adapt(value) if isinstance(value, datetime) else value)
    for column in rows[ids[0]]:
        # ELSE the column itself, never reached, gives the CASE the column's type when every
        # value is NULL (PostgreSQL would take it for text).
        quoted = connection.ops.quote_name(column)
        sets.append(f"{quoted} = CASE id {' '.join(['WHEN %s THEN %s'] * len(ids))} ELSE {quoted} END")
        for row_id in ids:
            value = rows[row_id][column]
            params += [row_id, adapt(value) if isinstance(value, datetime) else value]
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {', '.join(sets)} WHERE id IN (" + in_list(ids), params + ids)
        return cursor.rowcount


_KINDS: dict[str, tuple[dict[str, str], dict[str, str], dict[str, Any]]] = {}


def register(kind: str, templates: dict[str, str], tables: dict[str, str],
             names: dict[str, Any] | None = None) -> None:
    """Make `templates` available as `statements(connection, kind)`.

    `tables` maps placeholders to models ("app_label.Model"); `names` maps placeholders to
    Django choices, whose members the templates name: {job.ready} is JobStatus.READY as
    an SQL literal. Besides those, templates may use the dialect's fragments: {now},
    {later}, {random}, {skip_locked}, {for_update}, {upsert[conflict columns]}, {new[col]},
    {steps[col]} (a time axis's bar of a column: params its start, its step in seconds),
    {fence[col]} (the column's next fencing value, one parameter: `db.fence_floor`),
    {returning} (ends an INSERT whose id `cursor.lastrowid` reads) and {json} (a JSON
    text parameter whose type no column gives).
    """
    _KINDS[kind] = (templates, tables, names or {})


def _literals(choices: Any) -> SimpleNamespace:
    """The members of a choices class as SQL literals, by lower-case name (code's own
    constants, never caller input: numbers as they are, text quoted)."""
    return SimpleNamespace(**{
        member.name.lower(): str(int(member.value)) if isinstance(member.value, int) else f"'{member.value}'"
        for member in choices
    })


#: The database server's clock, the only clock that decides expiry (see leases.clock).
CLOCK = {"now": "SELECT {now}"}

register("resource", RESOURCE, {"t": "leases.Resource", "w": "leases.Waiter", "g": "leases.ResourceTarget"})
register("lock", LOCK, {"t": "leases.Lock"})
register("clock", CLOCK, {})
register("target", TARGET, {"t": "leases.ResourceTarget", "v": "leases.Verdict", "r": "leases.Resource"},
         {"kind": VerdictKind})


def statements(connection: BaseDatabaseWrapper, kind: str = "resource") -> SimpleNamespace:
    """The statements of one registered `kind` for this connection's vendor."""
    return _build(kind, connection.vendor, db.skip_locked(connection), connection.ops.quote_name)


class _Pattern(dict):
    """A fragment with an argument: {upsert[pool, value]} or {new[score]} in a template."""

    def __init__(self, pattern: str, field: str) -> None:
        super().__init__()
        self.pattern, self.field = pattern, field

    def __missing__(self, argument: str) -> str:
        return self.pattern.format(**{self.field: argument})


@lru_cache(maxsize=None)
def _build(kind: str, vendor: str, skip_locked: str, quote: Any) -> SimpleNamespace:
    from django.apps import apps

    templates, tables, names = _KINDS[kind]
    dialect = db.DIALECTS[vendor]
    fragments = {
        "now": dialect.now,
        "later": dialect.later,
        "random": dialect.random,
        "skip_locked": skip_locked,
        # A read of rows the transaction will change; SQLite's write lock already serialises.
        "for_update": "" if vendor == "sqlite" else " FOR UPDATE",
        "upsert": _Pattern(dialect.upsert, "keys"),
        "new": _Pattern(dialect.new, "col"),
        "steps": _Pattern(dialect.steps, "col"),
        # A fence's next value: one more, but at least the parameter (`db.fence_floor`).
        "fence": _Pattern(dialect.greatest + "({col} + 1, %s)", "col"),
        "returning": dialect.returning,
        "json": dialect.json,
        **{key: quote(apps.get_model(label)._meta.db_table) for key, label in tables.items()},
        **{key: _literals(choices) for key, choices in names.items()},
    }
    return SimpleNamespace(**{key: sql.format(**fragments) for key, sql in templates.items()})
