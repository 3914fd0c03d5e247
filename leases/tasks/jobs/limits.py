"""Per-key limits for jobs, across every worker: at most `concurrency` jobs of a key
running at once, at most N starts of a key per period (`rate`, a sliding window).

A job names its key (`limit_key`, from its handler or its push) and carries its limits;
a `LimitRule` whose prefix matches the key overrides them, so an operator can change
them without a deploy. Decisions about one key are made one at a time across workers,
under the lock of the key's `LimitKey` row (SQLite's write lock does the same), from what
the job rows say: the key's running jobs (a count, so a crashed worker's slots come back
with its jobs' recovery), and its starts within the window.

A job held back waits without using an attempt. Held back by concurrency, it and the
key's other ready jobs become `blocked`, off the claim's index, so the claim goes on
past a busy key to the others; each job of the key that stops running unblocks one, and
a periodic pass unblocks what a crash or a raised limit left. Held back by rate, it stays
ready with its run time moved to when the window has room.

Lock order: a claim holds the job rows it picked (SKIP LOCKED, never waiting for them),
then waits for its keys' rows, sorted; under a key's lock no statement waits for a job
row: what a decision holds back or unblocks is read with SKIP LOCKED and written by id.
A job row another claim holds is decided by that claim once it has the key. So two
claims of one key cannot deadlock (each waited for the other's rows before).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from leases import clock, db
from leases.sql import in_list
from leases.validation import check_name

from .. import sql
from ..models import KEY_LENGTH, LimitRule

log = logging.getLogger("leases.tasks.limits")

_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(s|m|h)\s*")
#: Rules are read again after this many seconds (a change in the admin reaches every worker).
RULES_TTL = 1.0
#: The most concurrency a key may have.
MAX_CONCURRENCY = 100_000
#: Ready jobs of a key at its limit one decision holds back at most (blocks, or delays to
#: its rate's window), besides those its claim picked; a claim that meets more does it again.
HOLD_BATCH = 1000


@dataclass(frozen=True)
class Limits:
    """A key's limits: running at once (None: no limit), starts per `period` seconds."""

    concurrency: int | None = None
    starts: int | None = None
    period: float = 1.0

    @property
    def any(self) -> bool:
        return self.concurrency is not None or self.starts is not None


def parse_rate(rate: Any) -> tuple[int, float]:
    """(starts, period in seconds) of "N/s", "N/m" or "N/h"; ValueError (one line) else."""
    found = _RATE.fullmatch(rate) if isinstance(rate, str) else None
    if found is None or int(found[1]) < 1 or int(found[1]) > MAX_CONCURRENCY * 100:
        raise ValueError(f"rate must be N/s, N/m or N/h with N a whole number >= 1 (e.g. '10/m'), not {rate!r}")
    return int(found[1]), _PERIODS[found[2]]


def check_rate(rate: Any) -> str:
    """A rate as it is stored ("10/m"), or "" for none."""
    if rate is None or rate == "":
        return ""
    starts, period = parse_rate(rate)
    return f"{starts}/{next(unit for unit, size in _PERIODS.items() if size == period)}"


def check_concurrency(concurrency: Any) -> int | None:
    if concurrency is None:
        return None
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be a whole number from 1 to {MAX_CONCURRENCY}, not {concurrency!r}")
    return concurrency


def check_limit_key(key: Any) -> str:
    """A job's key: a printable string of at most KEY_LENGTH characters ("" for none)."""
    if key is None or key == "":
        return ""
    if not isinstance(key, str):
        raise ValueError(f"limit_key must be a string, not {type(key).__name__} {key!r}")
    return check_name(key, "limit_key", KEY_LENGTH)


def key_of(limit_key: Any, payload: Any) -> str:
    """The key of a job: `limit_key` as given, or what it returns for the payload."""
    if callable(limit_key):
        try:
            limit_key = limit_key(payload)
        except Exception as exc:  # noqa: BLE001 - a handler's key function failing is bad input
            raise ValueError(f"limit_key function failed for this payload: {type(exc).__name__}: {exc}") from None
    return check_limit_key(limit_key)


# -- the rules ----------------------------------------------------------------------------

_rules: tuple[float, dict[str, Limits]] = (0.0, {})


def rules(using: str) -> dict[str, Limits]:
    """The operators' rules by prefix, read at most every RULES_TTL seconds."""
    global _rules
    if _rules[0] > time.monotonic():
        return _rules[1]
    found = {}
    for prefix, concurrency, rate in LimitRule.objects.using(using).values_list("prefix", "concurrency", "rate"):
        starts, period = parse_rate(rate) if rate else (None, 1.0)
        found[prefix] = Limits(concurrency, starts, period)
    _rules = (time.monotonic() + RULES_TTL, found)
    return found


def forget_rules() -> None:
    """Read the rules again at the next decision (after a change in this process)."""
    global _rules
    _rules = (0.0, {})


def limits_for(key: str, concurrency: int | None, rate: str, using: str) -> Limits:
    """The limits of `key`: the rule of its longest matching prefix, else the job's own."""
    matching = [prefix for prefix in rules(using) if key.startswith(prefix)]
    if matching:
        return rules(using)[max(matching, key=len)]
    starts, period = parse_rate(rate) if rate else (None, 1.0)
    return Limits(concurrency, starts, period)


# -- decisions, in the claim's and the outcomes' transactions -----------------------------


def _lock(cursor: Any, keys: list[str]) -> None:
    """Lock the keys' rows by writing them (see "lock_keys"), making those that do not exist yet."""
    st = sql.limits(cursor.db)
    cursor.execute(st.lock_keys + in_list(keys), keys)
    if cursor.rowcount == len(keys):
        return
    cursor.execute(st.existing_keys + in_list(keys), keys)
    missing = sorted(set(keys) - {row[0] for row in cursor.fetchall()})
    if missing:
        cursor.execute(st.add_keys + ", ".join(["(%s, 1)"] * len(missing)) + st.add_keys_tail, missing)


def _per_key(cursor: Any, statement: str, keys: list[str], head: tuple = ()) -> dict[str, tuple]:
    """{key: the rest of its row} of a grouped statement over `keys`."""
    cursor.execute(statement + in_list(keys) + sql.limits(cursor.db).by_key, (*head, *keys))
    return {row[0]: row[1:] for row in cursor.fetchall()}


def _room(cursor: Any, wanted: dict[str, Limits], now: datetime | None) -> dict[str, tuple[int, bool, datetime | None]]:
    """{key: (how many may start now, whether concurrency binds, when the rate's window
    next has room)}, under the keys' locks: a grouped read per kind of limit."""
    st = sql.limits(cursor.db)
    room = {key: (1 << 30, False, None) for key in wanted}
    capped = sorted(key for key, limits in wanted.items() if limits.concurrency is not None)
    if capped:
        running = _per_key(cursor, st.running_per_key, capped)
        for key in capped:
            room[key] = (max(0, wanted[key].concurrency - running.get(key, (0,))[0]), True, None)
    periods: dict[float, list[str]] = {}
    for key, limits in wanted.items():
        if limits.starts is not None:
            periods.setdefault(limits.period, []).append(key)
    for period, keys in periods.items():
        since = db.dialect(cursor.db).stored_datetime(now - timedelta(seconds=period))
        starts = _per_key(cursor, st.starts_per_key, sorted(keys), (since,))
        for key in keys:
            count, oldest = starts.get(key, (0, None))
            left = max(0, wanted[key].starts - count)
            if left < room[key][0]:
                # The window stays full until its oldest start leaves it; with none yet,
                # the starts made now fill it.
                free_at = (db.to_datetime(oldest) if oldest else now) + timedelta(seconds=period)
                room[key] = (left, False, free_at)
    return room


def within_limits(cursor: Any, rows: list[tuple], key_at: Callable[[tuple], tuple[str, int | None, str]],
                  using: str) -> tuple[list[tuple], float | None]:
    """(the picked rows that may start now, in their order; seconds until the soonest job
    delayed by a rate may start, or None). The others of a key at its limit are held
    back (blocked, or delayed to when its rate's window has room), in the claim's
    transaction. `key_at(row)` -> (limit key, concurrency, rate)."""
    keyed: dict[str, list[tuple]] = {}
    for row in rows:
        key = key_at(row)[0]
        if key:
            keyed.setdefault(key, []).append(row)
    wanted = {key: limits_for(key, *key_at(mine[0])[1:], using) for key, mine in keyed.items()}
    wanted = {key: limits for key, limits in wanted.items() if limits.any}
    if not wanted:
        return rows, None
    now = clock.now(cursor) if any(limits.starts is not None for limits in wanted.values()) else None
    st = sql.limits(cursor.db)
    _lock(cursor, sorted(wanted))
    held: set[int] = set()
    soonest: float | None = None
    for key, (room, by_concurrency, free_at) in sorted(_room(cursor, wanted, now).items()):
        mine = keyed[key]
        if room >= len(mine):
            continue
        kept = [row[0] for row in mine[room:]]
        held.update(kept)
        ids = _holdable(cursor, key, kept, {row[0] for row in mine[:room]})
        if by_concurrency:
            cursor.execute(st.block + in_list(ids), ids)
        else:
            when = db.dialect(cursor.db).stored_datetime(free_at)
            cursor.execute(st.delay + in_list(ids), (when, when, *ids))
            wait = (free_at - now).total_seconds()
            soonest = wait if soonest is None else min(soonest, wait)
    return [row for row in rows if row[0] not in held], soonest


def _holdable(cursor: Any, key: str, kept: list[int], taken: set[int]) -> list[int]:
    """The key's ready jobs a decision holds back: those of the claim it did not take, and
    up to HOLD_BATCH others in claim order that no other transaction holds (SKIP LOCKED:
    under the key's lock nothing waits for a job row)."""
    cursor.execute(sql.limits(cursor.db).holdable, (key, HOLD_BATCH))
    found = [row[0] for row in cursor.fetchall() if row[0] not in taken]
    return list(dict.fromkeys(kept + found))


def free_slots(cursor: Any, ended: Iterable[tuple[str, int | None, str]], using: str) -> int:
    """After jobs of these keys stopped running (in the same transaction): unblock as many
    of each key's blocked jobs as it now has room for. Returns how many.

    The keys are locked first, so a claim deciding to block at the same moment has either
    committed its blocked jobs (and they are seen here) or waits and sees the room."""
    limited = {key: (concurrency, rate) for key, concurrency, rate in ended if key}
    if not limited:
        return 0
    keys = sorted(limited)
    _lock(cursor, keys)
    blocked = _per_key(cursor, sql.limits(cursor.db).blocked_per_key, keys)
    unblocked = 0
    for key in sorted(blocked):
        unblocked += _unblock(cursor, key, limits_for(key, *limited[key], using))
    return unblocked


def _unblock(cursor: Any, key: str, limits: Limits) -> int:
    """Ready as many of `key`'s blocked jobs as it has room for (its row is locked)."""
    st = sql.limits(cursor.db)
    if limits.concurrency is None:
        room = 1 << 30  # no concurrency limit (any more): all of them
    else:
        running = _per_key(cursor, st.running_per_key, [key]).get(key, (0,))[0]
        room = max(0, limits.concurrency - running)
    if not room:
        return 0
    cursor.execute(st.next_blocked, (key, min(room, 1000)))
    ids = [row[0] for row in cursor.fetchall()]
    if ids:
        cursor.execute(st.unblock + in_list(ids), ids)
    return len(ids)


def unblock_pass(using: str) -> dict[str, int]:
    """Unblock what has room: the periodic safety net for slots freed by a crash's
    recovery, a raised limit, or a job deleted. Returns the blocked count per key seen."""
    using = db.alias(using)

    def keys(cursor: Any, resumed: bool) -> dict[str, int]:
        cursor.execute(sql.limits(cursor.db).blocked_keys, ())
        return dict(cursor.fetchall())

    blocked = db.run(keys, using)
    for key in sorted(blocked):

        def work(cursor: Any, resumed: bool, key: str = key) -> int:
            with db.write_transaction(using):
                _lock(cursor, [key])
                cursor.execute(sql.limits(cursor.db).limits_carried, (key,))
                row = cursor.fetchone()
                concurrency, rate = row if row else (None, "")
                return _unblock(cursor, key, limits_for(key, concurrency, rate or "", using))

        if db.run(work, using):
            log.info("limits: unblocked jobs of key %s", key)
    return blocked

