"""How a pool's resources stand for one target, for operators: "why is site X stuck?" in
numbers (`standing`), and the rows behind it: the verdicts in force (`in_force`) and the
log of who said what (`history`). The commands, the admin, the dashboard, `jobs stats`
and a worker's log line all read these, so they give one answer.

Cheap whatever the pool's size: the slots are counted in one grouped read of the pool,
the target's refusals read through the (pool, target) index, and a handler's `where=`
is tried on at most FILTER_READ free slots.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import clock, db, routing
from ..durations import whole
from ..encoding import load_json
from ..models import ResourceTarget, Verdict
from ..sql import statements

#: Free slots on which a handler's filter is tried; past it, the usable count is a floor.
FILTER_READ = 1000

#: The words of each reason a slot cannot start work for a target, in the order a slot
#: is given one (a held slot that its target also bans counts as held).
REASONS = (("quarantined", "quarantined"), ("held", "held"), ("cooling", "cooling down"),
           ("banned", "banned"), ("rested", "resting"), ("paced", "paced"),
           ("filtered", "not matching the handler's where="))
#: What ends for a refused slot to come back, by why it is refused.
ENDS = {"banned": "a ban", "rested": "a rest", "paced": "a pace"}


@dataclass(frozen=True)
class Standing:
    """A pool's slots as one target sees them now (the database clock): how many could
    start work for it, why the others cannot, and when the first of those may (held slots
    aside: they come back when their holder lets go)."""

    pool: str
    target: str
    slots: int
    resources: int
    usable: int
    quarantined: int = 0
    held: int = 0
    cooling: int = 0
    banned: int = 0
    rested: int = 0
    paced: int = 0
    filtered: int = 0
    partial: bool = False  # the filter was tried on FILTER_READ slots only: usable is a floor
    next_at: datetime | None = None
    next_why: str = ""
    now: datetime | None = None

    @property
    def blocked(self) -> bool:
        """Whether no slot could start work for the target now."""
        return self.usable == 0

    def counts(self) -> list[tuple[str, int]]:
        """(words, slots) of each reason that applies, in REASONS' order."""
        return [(words, getattr(self, field)) for field, words in REASONS if getattr(self, field)]

    def summary(self, until: Callable[[datetime], str] | None = None) -> str:
        """One line: "0 of 10 resources usable for shop.example: 6 banned, 4 held; the
        next in 3m (a ban of p4 ends)". `until` words a time (default: "in 3m")."""
        unit = "resources" if self.slots == self.resources else "slots"
        whom = f" for {self.target}" if self.target else ""
        usable = f"{self.usable}{'+' if self.partial else ''}"
        if not self.slots:
            return f"pool {self.pool} has no resources"
        line = f"{usable} of {self.slots} {unit} usable{whom}"
        reasons = ", ".join(f"{count} {words}" for words, count in self.counts())
        if reasons:
            line += f": {reasons}"
        if self.blocked and self.next_at is not None:
            words = until(self.next_at) if until else f"in {whole((self.next_at - self.now).total_seconds())}"
            line += f"; the next {words} ({self.next_why})"
        elif self.blocked and self.held:
            line += "; the next when a holder lets go"
        return line


def standing(pool: str, target: str = "", qualifies: Callable[[Any], bool] | None = None,
             using: str | None = None) -> Standing:
    """How the slots of `pool` stand for `target` ("" for jobs of no target) and, with
    `qualifies` (a handler's `where=` as a function of a resource's data), for that filter."""
    return db.run(lambda cursor, resumed: _standing(cursor, pool, target, qualifies),
                  routing.route("pools", pool, using))


def _standing(cursor: Any, pool: str, target: str, qualifies: Callable[[Any], bool] | None) -> Standing:
    now = clock.now(cursor)
    st = statements(cursor.db, "target")
    cursor.execute(st.slots, (pool,))
    total, names, quarantined, held, cooling, quarantine_ends, cooling_ends = cursor.fetchone()
    total, names, quarantined, held, cooling = (int(v or 0) for v in (total, names, quarantined, held, cooling))
    ends = [(db.to_datetime(at), why) for at, why in ((quarantine_ends, "a quarantine ends"),
                                                      (cooling_ends, "a cool-down ends")) if at is not None]
    refused = {"banned": 0, "rested": 0, "paced": 0}
    if target:
        cursor.execute(st.refused, (pool, target))
        for name, count, *times, _reason in cursor.fetchall():
            banned, rested, paced = (None if t is None else db.to_datetime(t) for t in times)
            why = ("banned" if banned and banned > now else "rested" if rested and rested > now else "paced")
            refused[why] += int(count)
            last = max(t for t in (banned, rested, paced) if t is not None and t > now)
            ends.append((last, f"{ENDS[why]} of {name} ends"))
    usable = total - quarantined - held - cooling - sum(refused.values())
    filtered, partial = 0, False
    if qualifies is not None and usable > 0:
        kind = statements(cursor.db)
        if target:
            cursor.execute(kind.candidates_for, (pool, pool, target, FILTER_READ))
        else:
            cursor.execute(kind.candidates, (pool, FILTER_READ))
        rows = cursor.fetchall()
        fitting = sum(1 for row in rows if qualifies(load_json(row[3])))
        partial = len(rows) == FILTER_READ and usable > FILTER_READ
        filtered = len(rows) - fitting if not partial else 0
        usable = fitting if partial else usable - filtered
    first = min(ends, key=lambda end: end[0]) if ends else (None, "")
    return Standing(pool=pool, target=target, slots=total, resources=names, usable=max(usable, 0),
                    quarantined=quarantined, held=held, cooling=cooling, filtered=filtered, partial=partial,
                    next_at=first[0], next_why=first[1], now=now, **refused)


def in_force(using: str, pool: str | None = None, target: str | None = None,
             name: str | None = None) -> tuple[datetime, list[ResourceTarget]]:
    """The server's clock and the bans, rests and paces in force on database `using`,
    by pool, resource and target."""
    now = clock.db_now(using)
    rows = ResourceTarget.objects.using(using).filter(_live(now))
    for field, value in (("pool", pool), ("target", target), ("name", name)):
        if value is not None:
            rows = rows.filter(**{field: value})
    return now, list(rows.order_by("pool", "name", "target"))


def _live(now: datetime) -> Any:
    from django.db.models import Q

    return Q(banned_until__gt=now) | Q(rested_until__gt=now) | Q(next_start_at__gt=now)


def history(using: str, pool: str | None = None, name: str | None = None, target: str | None = None,
            job: int | None = None, limit: int = 50) -> list[Verdict]:
    """The last `limit` lines of the verdict log on database `using`, newest first: bans,
    rests and lifts, of a pool, a resource, a target or a job's attempts."""
    rows = Verdict.objects.using(using)
    for field, value in (("pool", pool), ("name", name), ("target", target), ("job", job)):
        if value is not None:
            rows = rows.filter(**{field: value})
    return list(rows.order_by("-at", "-id")[:limit])
