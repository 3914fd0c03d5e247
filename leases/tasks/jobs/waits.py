"""Jobs that wait for a resource, and why, for operators: due jobs grouped by pool, target
and the handler's `where=`, each with how the pool stands for them (`leases.targets`:
held, cooling, quarantined, banned, resting or paced for the target, filtered out).
`jobs stats`, `jobs show`, the admin, the dashboard and a worker's log line read it here,
so "why is site X stuck?" has one answer everywhere.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leases import db, targets

from .. import sql
from ..needs import Needs
from .leasing import needs_for

#: Groups (pool, target, filter) that one look examines at most, most due jobs first: a
#: crawl over a thousand sites must not cost a thousand reads at every look.
SHOWN = 20


@dataclass(frozen=True)
class Wait:
    """Due jobs of one pool and target (and handler filter) waiting for a resource."""

    pool: str
    target: str
    where: dict
    due: int
    standing: targets.Standing

    @property
    def reason(self) -> str:
        """How the pool stands for these jobs, in one line."""
        line = self.standing.summary()
        return line + (f" (where={json.dumps(self.where, sort_keys=True)})" if self.where else "")


@dataclass(frozen=True)
class _Group:
    pool: str
    target: str
    where: dict
    due: int


def due_per_pool(using: str) -> dict[str, int]:
    """{pool: its due jobs}, in one grouped read of the ready rows of the claim index."""
    found: dict[str, int] = {}
    for group in _groups(using):
        found[group.pool] = found.get(group.pool, 0) + group.due
    return found


def waiting(using: str, every: bool = True, pools: Sequence[str] | None = None, limit: int = SHOWN) -> list[Wait]:
    """The due jobs of each pool and target (at most `limit` groups, most due first), with
    how their pool stands for them; `every=False`: only those none of whose slots could
    start now (what a worker's log line names); `pools`: only these pools."""
    groups = [g for g in _groups(using) if pools is None or g.pool in pools]
    groups.sort(key=lambda g: (-g.due, g.pool, g.target))
    waits = []
    for group in groups[:limit]:
        found = targets.standing(group.pool, group.target, _qualifies(group.pool, group.where), using=using)
        if every or found.blocked:
            waits.append(Wait(group.pool, group.target, group.where, group.due, found))
    return waits


def more_than_shown(using: str, limit: int = SHOWN) -> int:
    """How many groups `waiting` leaves out past `limit`."""
    return max(0, len(_groups(using)) - limit)


def of_job(job: Any, using: str) -> targets.Standing:
    """How a waiting job's pool stands for it: its target and its handler's `where=`."""
    needs = needs_for(job.name, job.backend)
    return targets.standing(job.pool, job.target, _qualifies(job.pool, dict(needs.where) if needs else {}),
                            using=using)


def _qualifies(pool: str, where: dict) -> Callable[[Any], bool] | None:
    """The test of a resource's data by a handler's `where=` (None: every one qualifies)."""
    return Needs(pool, where=where).qualifies if where else None


def _groups(using: str) -> list[_Group]:
    """Due jobs by pool, target and the `where=` of their handler (as this process knows it)."""

    def work(cursor: Any, resumed: bool) -> list[tuple]:
        cursor.execute(sql.leasing(cursor.db).due_per_target, ())
        return cursor.fetchall()

    merged: dict[tuple[str, str, str], int] = {}
    for pool, target, name, backend, count in db.run(work, using):
        needs = needs_for(name, backend)
        where = json.dumps(dict(needs.where) if needs else {}, sort_keys=True)
        merged[pool, target, where] = merged.get((pool, target, where), 0) + int(count)
    return [_Group(pool, target, json.loads(where), due) for (pool, target, where), due in merged.items()]
