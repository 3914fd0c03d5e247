"""What each target (a site, a domain) says of a pool's resources: bans, rests and pace.

A site's 403 or 429 says nothing about a proxy's standing elsewhere, so its verdict is
kept per (resource, target): a resource banned by one target stays usable for the others,
a cool-down (a `Retry-After`) rests it for its target only, and a pace ("one start per
2 s per proxy per domain") spaces its starts there. Quarantine of the whole resource
stays the operator's (`Pool.quarantine`). Jobs that hold resources (`leases.tasks`) and
the Scrapy middleware read and write the same rows, so they share one view of which
resource is banned where. Every time is the database server's, computed in the statement.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import db, routing
from .models import ResourceTarget
from .sql import in_list, statements
from .validation import (
    POOL_NAME_LENGTH,
    RESOURCE_NAME_LENGTH,
    check_name,
    check_seconds,
    check_target,
    clean_text,
)

#: Rows whose times all passed this long ago are deleted (`forget`).
FORGET_AFTER = 86400.0
#: Characters of a ban's reason that are kept.
REASON_LENGTH = 255


@dataclass(frozen=True)
class Unusable:
    """Why a target cannot use a resource now, and until when (the database clock)."""

    name: str
    why: str  # banned, rested or paced
    until: datetime


def verdict(cursor: Any, kind: str, pool: str, name: str, target: str, seconds: float, reason: str = "") -> None:
    """Record a "ban" or a "rest" of resource `name` for `target`, `seconds` from now, in
    the caller's transaction (a job's ending)."""
    check_target(target)
    seconds = check_seconds(seconds, f"{kind} seconds")
    statement = getattr(statements(cursor.db, "target"), kind)
    cursor.execute(statement, (pool, target, name, db.dialect(cursor.db).seconds(seconds),
                               clean_text(reason, REASON_LENGTH)))


def _verdict(kind: str, pool: str, name: str, target: str, seconds: float, reason: str,
             using: str | None) -> None:
    check_name(pool, "pool name", POOL_NAME_LENGTH)
    check_name(name, "resource name", RESOURCE_NAME_LENGTH)
    check_target(target)
    check_seconds(seconds, f"{kind} seconds")
    # An upsert: done twice after a lost reply, the same.
    db.run(lambda cursor, resumed: verdict(cursor, kind, pool, name, target, seconds, reason),
           routing.route("pools", pool, using))


def ban(pool: str, name: str, target: str, seconds: float, reason: str = "", using: str | None = None) -> None:
    """`target` will not use resource `name` for `seconds` (the latest ban decides)."""
    _verdict("ban", pool, name, target, seconds, reason, using)


def rest(pool: str, name: str, target: str, seconds: float, using: str | None = None) -> None:
    """`target` will not use resource `name` for `seconds`: a cool-down, as a site's
    `Retry-After` asks; the others still use it."""
    _verdict("rest", pool, name, target, seconds, "", using)


def pace(cursor: Any, pool: str, pairs: Iterable[tuple[str, str]], seconds: float) -> None:
    """Space the next start of each (name, target) by `seconds` from now, in the caller's
    transaction (a claim's)."""
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


def lift(pool: str, name: str, target: str = "", using: str | None = None) -> int:
    """End the bans and rests of resource `name`, for `target` or ("") every target;
    returns how many targets' verdicts ended."""

    def work(cursor: Any, resumed: bool) -> int:
        cursor.execute(statements(cursor.db, "target").lift, (pool, name, target, target))
        return cursor.rowcount

    return db.run(work, routing.route("pools", pool, using))


def of_resource(pool: str, name: str, using: str | None = None) -> list[ResourceTarget]:
    """What each target says of resource `name` (for operators), by target."""
    return list(ResourceTarget.objects.using(routing.route("pools", pool, using))
                .filter(pool=pool, name=name).order_by("target"))


def forget(using: str | None = None, older_than: float = FORGET_AFTER) -> int:
    """Delete the rows whose every time passed more than `older_than` seconds ago."""

    def work(cursor: Any, resumed: bool) -> int:
        cursor.execute(statements(cursor.db, "target").forget, (db.dialect(cursor.db).seconds(-older_than),))
        return cursor.rowcount

    return db.run(work, db.alias(using))

