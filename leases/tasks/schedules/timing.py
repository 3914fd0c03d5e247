"""When a schedule's ticks fall: a cron expression in a time zone, every N seconds, or
once at a moment; and the check of a timing as callers give it.

Cron expressions are evaluated in the schedule's time zone by cronsim, with Debian
cron's rules across DST changes: a wall-clock time that happens twice fires once, one
that does not exist fires once, at the next valid minute.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings

from leases.validation import check_name

from ..models import NAME_LENGTH

#: Shortest interval of an `every` schedule (the leader passes at least twice a second).
MIN_EVERY = 1.0
#: Answers of cron expressions kept (see `_cron_after`).
CRON_CACHE = 4096


@dataclass(frozen=True)
class Timing:
    """When a schedule's ticks fall: a cron expression in a time zone, every N seconds from
    its first tick, or once at a moment. All times are aware, in UTC."""

    cron: str = ""
    every: float | None = None
    at: datetime | None = None
    timezone: str = "UTC"

    @classmethod
    def of(cls, row: Any) -> Timing:
        """The timing of a schedule (a Schedule, or a row a pass read)."""
        return cls(row.cron, row.every, row.at, row.timezone)

    def first(self, now: datetime) -> datetime | None:
        """The first tick of a schedule made (or re-timed, or enabled) at `now`."""
        if self.at is not None:
            return self.at if self.at > now else None
        if self.every is not None:
            return now + timedelta(seconds=self.every)
        return self.after(now)

    def after(self, moment: datetime) -> datetime | None:
        """The first tick strictly after `moment` (a tick of the sequence through it)."""
        if self.at is not None:
            return None  # a one-off has no tick after its own
        if self.every is not None:
            return moment + timedelta(seconds=self.every)
        return _cron_after(self.cron, self.timezone, moment)

    def due(self, first: datetime, now: datetime, limit: int) -> list[datetime]:
        """The ticks from `first` (a tick) to `now`, at most the newest `limit` of them."""
        if first > now:
            return []
        if self.at is not None:
            return [first]
        if self.every is not None:
            step = timedelta(seconds=self.every)
            count = int((now - first) / step) + 1
            start = max(0, count - limit)
            return [first + step * index for index in range(start, count)]
        return list(_cron_due(self.cron, self.timezone, first, now, limit))

    def upcoming(self, start: datetime | None, count: int) -> list[datetime]:
        """`start` (a schedule's next tick) and the ticks after it, `count` in all."""
        found: list[datetime] = []
        tick = start
        while tick is not None and len(found) < count:
            found.append(tick)
            tick = self.after(tick)
        return found

    def describe(self) -> str:
        """The timing in words, as operators read it."""
        if self.at is not None:
            return f"once at {self.at:%Y-%m-%d %H:%M:%S}Z"
        if self.every is not None:
            return f"every {_interval(self.every)}"
        try:
            words = CronSim(self.cron, datetime(2000, 1, 1)).explain()
        except Exception:  # noqa: BLE001 - cronsim cannot put every expression in words
            words = self.cron
        return words + (f" ({self.timezone})" if self.timezone != "UTC" else "")


def _cron(cron: str, timezone: str, moment: datetime, reverse: bool = False) -> Iterator[datetime]:
    local = moment.astimezone(ZoneInfo(timezone)).replace(microsecond=0)
    for tick in CronSim(cron, local, reverse=reverse):
        yield tick.astimezone(UTC)


# A burst is many schedules of a few cron expressions at the same tick, and a pass reads
# the clock once per batch: the same questions, each costing cronsim some 100 us.
@lru_cache(maxsize=CRON_CACHE)
def _cron_after(cron: str, timezone: str, moment: datetime) -> datetime | None:
    return next(_cron(cron, timezone, moment), None)


@lru_cache(maxsize=CRON_CACHE)
def _cron_due(cron: str, timezone: str, first: datetime, now: datetime, limit: int) -> tuple[datetime, ...]:
    newest: list[datetime] = []
    for tick in _cron(cron, timezone, now + timedelta(seconds=1), reverse=True):
        if tick < first or len(newest) == limit:
            break
        if tick <= now:
            newest.append(tick)
    return tuple(newest[::-1]) or (first,)


def _interval(seconds: float) -> str:
    """90 -> 1m30s, 3600 -> 1h, 86400 -> 1d: an interval as operators write it."""
    if seconds != int(seconds) or seconds < 60:
        return f"{seconds:g}s"
    parts, left = [], int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts)


def _timezone(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"timezone must be a time zone name such as 'Europe/Berlin', not {name!r}")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}") from None
    return name


def check_timing(cron: Any = None, every: Any = None, at: Any = None, timezone: Any = None,
                 now: datetime | None = None) -> Timing:
    """The timing of a schedule, or ValueError with one line: exactly one of cron, every
    and at; a cron expression cronsim accepts; every of at least MIN_EVERY seconds; an
    aware `at` in the future (by `now`, the database clock)."""
    given = [name for name, value in (("cron", cron), ("every", every), ("at", at)) if value not in (None, "")]
    if len(given) != 1:
        raise ValueError(f"give exactly one of cron, every and at (got {', '.join(given) or 'none'})")
    zone = _timezone(timezone or settings.TIME_ZONE or "UTC")
    if cron not in (None, ""):
        if not isinstance(cron, str):
            raise ValueError(f"cron must be a string such as '0 3 * * *', not {cron!r}")
        check_name(cron, "cron", NAME_LENGTH)
        if len(cron.split()) != 5:
            raise ValueError(f"cron expression {cron!r} must have five fields: minute hour day month weekday")
        try:
            CronSim(cron, datetime(2000, 1, 1))
        except CronSimError as exc:
            raise ValueError(f"invalid cron expression {cron!r}: {exc}") from None
        return Timing(cron=cron, timezone=zone)
    if every not in (None, ""):
        seconds = every.total_seconds() if isinstance(every, timedelta) else every
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds == seconds:
            raise ValueError(f"every must be a number of seconds or a timedelta, not {every!r}")
        if seconds < MIN_EVERY or seconds > 10 * 365 * 86400:
            raise ValueError(f"every must be from {MIN_EVERY:g} second to ten years, not {seconds!r}")
        return Timing(every=float(seconds), timezone=zone)
    if not isinstance(at, datetime):
        raise ValueError(f"at must be a datetime, not {at!r}")
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"at must be an aware datetime (with a time zone), not {at.isoformat()}")
    at = at.astimezone(UTC)
    if now is not None and at <= now:
        raise ValueError(f"at {at.isoformat()} is in the past (the database clock says {now.isoformat()})")
    return Timing(at=at, timezone=zone)
