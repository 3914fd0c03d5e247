"""Verdicts: a target bans or rests a resource, paces its starts, or an operator lifts its
bans and rests. What is in force lives in `ResourceTarget` (a row per resource and target,
read by every claim); each ban, rest and lift is also a line of the `Verdict` log, written
in the same transaction, naming who said it."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import db, routing
from ..choices import VerdictKind
from ..models import HOLDER_LENGTH, ResourceTarget
from ..sql import in_list, statements
from ..validation import (
    POOL_NAME_LENGTH,
    RESOURCE_NAME_LENGTH,
    check_name,
    check_seconds,
    check_target,
    clean_text,
)

#: Rows whose times all passed this long ago are deleted (`forget`), and log lines as old.
FORGET_AFTER = 86400.0
#: Characters of a ban's reason that are kept.
REASON_LENGTH = 255


@dataclass(frozen=True)
class Unusable:
    """Why a target cannot use a resource now, and until when (the database clock)."""

    name: str
    why: str  # banned, rested or paced
    until: datetime


def verdict(cursor: Any, kind: str, pool: str, name: str, target: str, seconds: float, reason: str = "",
            holder: str = "", job: int | None = None, log: bool = True) -> None:
    """Record a "ban" or a "rest" of resource `name` for `target`, `seconds` from now, in
    the caller's transaction (a job's ending), and (`log`) its line in the log: said by
    `holder`, for the attempt of `job` if a job's."""
    check_target(target)
    seconds = check_seconds(seconds, f"{kind} seconds")
    kind = VerdictKind(kind)
    dialect, reason = db.dialect(cursor.db), clean_text(reason, REASON_LENGTH)
    st = statements(cursor.db, "target")
    cursor.execute(getattr(st, kind.value), (pool, target, name, dialect.seconds(seconds), reason))
    if log:
        cursor.execute(st.log, (pool, name, target, kind.value, reason, dialect.seconds(seconds),
                                clean_text(holder, HOLDER_LENGTH), job))


def _verdict(kind: str, pool: str, name: str, target: str, seconds: float, reason: str, holder: str,
             using: str | None) -> None:
    check_name(pool, "pool name", POOL_NAME_LENGTH)
    check_name(name, "resource name", RESOURCE_NAME_LENGTH)
    check_target(target)
    check_seconds(seconds, f"{kind} seconds")

    def work(cursor: Any, resumed: bool) -> None:
        # The upsert is the same done twice; after a lost reply the log's line is written
        # again only if the first try's is not the last one there.
        log = not (resumed and holder and _said_last(cursor, kind, pool, name, target, holder))
        verdict(cursor, kind, pool, name, target, seconds, reason, holder, log=log)

    db.run(work, routing.route("pools", pool, using))


def _said_last(cursor: Any, kind: str, pool: str, name: str, target: str, holder: str) -> bool:
    """Whether the resource's last line for the target is this holder's verdict."""
    cursor.execute(statements(cursor.db, "target").last_said, (pool, name, target))
    return cursor.fetchone() == (kind, clean_text(holder, HOLDER_LENGTH))


def ban(pool: str, name: str, target: str, seconds: float, reason: str = "", using: str | None = None,
        holder: str = "") -> None:
    """`target` will not use resource `name` for `seconds` (the latest ban decides);
    `holder` says who saw it, for the log."""
    _verdict("ban", pool, name, target, seconds, reason, holder, using)


def rest(pool: str, name: str, target: str, seconds: float, using: str | None = None, holder: str = "") -> None:
    """`target` will not use resource `name` for `seconds`: a cool-down, as a site's
    `Retry-After` asks; the others still use it."""
    _verdict("rest", pool, name, target, seconds, "", holder, using)


def pace(cursor: Any, pool: str, pairs: Iterable[tuple[str, str]], seconds: float) -> None:
    """Space the next start of each (name, target) by `seconds` from now, in the caller's
    transaction (a claim's). Not logged: one comes with every start."""
    statement, step = statements(cursor.db, "target").pace, db.dialect(cursor.db).seconds(seconds)
    for name, target in sorted(set(pairs)):
        cursor.execute(statement, (pool, target, name, step, ""))


def unusable(cursor: Any, pool: str, target: str, names: Iterable[str]) -> dict[str, Unusable]:
    """{name: why and until when} of the `names` that `target` cannot use now, in the
    caller's transaction: an index read of (pool, target) and those names."""
    names = sorted(set(names))
    if not names:
        return {}
    cursor.execute(statements(cursor.db, "target").unusable + in_list(names), (pool, target, *names))
    found = {}
    for name, banned, rested, paced in cursor.fetchall():
        times = [(why, db.to_datetime(until)) for why, until in (("banned", banned), ("rested", rested),
                                                                  ("paced", paced)) if until is not None]
        why, until = max(times, key=lambda item: item[1])
        found[name] = Unusable(name, why, until)
    return found


def unusable_now(pool: str, target: str, names: Iterable[str], using: str | None = None) -> dict[str, Unusable]:
    """`unusable`, in a unit of work of its own."""
    return db.run(lambda cursor, resumed: unusable(cursor, pool, target, names), routing.route("pools", pool, using))


def lift(pool: str, name: str = "", target: str = "", using: str | None = None, by: str = "",
         reason: str = "") -> list[tuple[str, str]]:
    """End the bans and rests of resource `name` for `target`: of every target ("" target),
    or of every resource for that target ("" name), not both. Each lift is a line of the
    log, said `by` an operator. Returns the (name, target) pairs whose verdicts ended."""
    check_name(pool, "pool name", POOL_NAME_LENGTH)
    if not name and not target:
        raise ValueError("name a resource, a target or both: a lift of a whole pool is one too many")
    if name:
        check_name(name, "resource name", RESOURCE_NAME_LENGTH)
    if target:
        check_target(target)
    by, reason = clean_text(by, HOLDER_LENGTH), clean_text(reason, REASON_LENGTH)

    def work(cursor: Any, resumed: bool) -> list[tuple[str, str]]:
        st = statements(cursor.db, "target")
        cursor.execute(st.in_force, (pool, name, name, target, target))
        rows = cursor.fetchall()
        if not rows:
            return []
        cursor.execute(st.lift + in_list(rows), [row[0] for row in rows])
        pairs = sorted((lifted, of) for _, lifted, of in rows)
        for lifted, of in pairs:
            cursor.execute(st.log_lift, (pool, lifted, of, reason, by))
        return pairs

    return db.run(work, routing.route("pools", pool, using))


def of_resource(pool: str, name: str, using: str | None = None) -> list[ResourceTarget]:
    """What each target says of resource `name` (for operators), by target."""
    return list(ResourceTarget.objects.using(routing.route("pools", pool, using))
                .filter(pool=pool, name=name).order_by("target"))


def forget(using: str | None = None, older_than: float = FORGET_AFTER) -> int:
    """Delete the rows whose every time passed more than `older_than` seconds ago, and the
    log's lines as old; returns how many rows of what is in force went."""

    def work(cursor: Any, resumed: bool) -> int:
        st, ago = statements(cursor.db, "target"), db.dialect(cursor.db).seconds(-older_than)
        cursor.execute(st.forget, (ago,))
        gone = cursor.rowcount
        cursor.execute(st.forget_log, (ago,))
        return gone

    return db.run(work, db.alias(using))
