"""A named pool of resources that processes on many hosts lease: a slot each, exclusively.

Which resource a caller gets: one of the few slots that came free longest ago (an index
range read of `(pool, busy_before)`, whatever the pool's size), tried in random order so
a crowd of acquirers spreads over them. So the pool is used least-recently-used first,
which rests each resource as long as the pool allows; a `cooldown` rests it at least that
long. With `fair=True`, waiters are served in the order they arrived.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from django.db import Error, IntegrityError, connections, transaction

from . import db, routing
from .encoding import dump_json, load_json
from .exceptions import NoResourceAvailable, UnknownPool, UnknownResource
from .lease import Heartbeat, Lease, make_holder
from .models import POOL_NAME_LENGTH, RESOURCE_NAME_LENGTH, Resource
from .sql import statements
from .validation import check_cooldown, check_name, check_slots, check_target, check_ttl, check_wait

log = logging.getLogger("leases")

#: Free rows read per attempt (the longest free); losing the race for one moves on to
#: the next. More spread racing acquirers further; each costs a row read.
CANDIDATES = 8
#: Reads of fresh candidates before a failed attempt counts as "pool exhausted".
ROUNDS = 3
#: Seconds a fair waiter's ticket lives unless renewed: a dead waiter stops holding up
#: the others after this long.
TICKET_TTL = 3.0
#: Seconds between two looks of a fair waiter at the line (and tries of the first in it).
FAIR_POLL = 0.05


def check_data(data: Any) -> Any:
    """JSON only, and storable as it is: refuse it before anything is written."""
    dump_json(data, "data")
    return data


#: Pool names an UnknownPool error lists.
KNOWN_SHOWN = 20


def unknown_pool(name: str, using: str | None = None) -> UnknownPool:
    """The error for a pool with no resources, naming the pools there are (a typo is the
    usual cause). Off the hot path: it reads pool names through the `(pool, ...)` index."""
    known = list(Resource.objects.using(db.alias(using)).order_by("pool").values_list("pool", flat=True)
                 .distinct()[: KNOWN_SHOWN + 1])
    listed = ", ".join(known[:KNOWN_SHOWN]) + (", ..." if len(known) > KNOWN_SHOWN else "")
    return UnknownPool(f"pool {name!r} has no resources (known pools: {listed or 'none yet'})")


@dataclass(frozen=True)
class _Claim:
    """A claim sent for one candidate row: (id, token, name, data, server clock) as read,
    when the row was read and when the claim was sent (local monotonic clock)."""

    row: tuple
    mono_anchor: float
    sent_at: float

    @property
    def id(self) -> int:
        return self.row[0]

    @property
    def token(self) -> int:
        return self.row[1]


class _Line:
    """A fair waiter's place in its pool's line: a ticket row, renewed while it waits."""

    def __init__(self, pool: Pool, holder: str) -> None:
        self.pool, self.holder = pool, holder
        self.ticket: int | None = None

    def first(self) -> bool:
        """Take a ticket (or renew ours); whether ours is the oldest live one."""

        def work(cursor: Any, resumed: bool) -> bool:
            st, seconds = statements(cursor.db), db.dialect(cursor.db).seconds(TICKET_TTL)
            if self.ticket is None:
                if not resumed:
                    cursor.execute(st.lapsed_waiters, (self.pool.name,))
                    cursor.execute(st.wait, (self.pool.name, self.holder, seconds))
                cursor.execute(st.ticket, (self.pool.name, self.holder))
                row = cursor.fetchone()
                if row is None:  # a lost reply hid an insert that did not happen
                    cursor.execute(st.wait, (self.pool.name, self.holder, seconds))
                    cursor.execute(st.ticket, (self.pool.name, self.holder))
                    row = cursor.fetchone()
                self.ticket = row[0]
            else:
                cursor.execute(st.still_waiting, (seconds, self.ticket))
            cursor.execute(st.first_waiter, (self.pool.name,))
            head = cursor.fetchone()
            return head is not None and head[0] == self.ticket

        return db.run(work, self.pool.using)

    def leave(self) -> None:
        """Give the place up (best effort: a ticket left behind lapses in TICKET_TTL)."""
        if self.ticket is None:
            return
        try:
            db.run(lambda cursor, resumed: cursor.execute(statements(cursor.db).done_waiting, (self.ticket,)),
                   self.pool.using, attempts=2)
        except Error:
            log.info("pool %r: could not leave the line; the ticket lapses in %gs", self.pool.name, TICKET_TTL)


class Pool:
    """Resources of one pool. Cheap to create; holds no connection or state of its own.

    `cooldown`: seconds a released slot rests before it is handed out again (a lease's
    `release(cooldown=...)` overrides it). `target`: acquire only resources this target (a
    site) does not refuse now, by its bans, rests and pace (`leases.targets`).
    """

    def __init__(self, name: str, using: str | None = None, cooldown: float = 0.0, target: str | None = None) -> None:
        self.name = check_name(name, "pool name", POOL_NAME_LENGTH)
        self.using = routing.route("pools", self.name, using)
        self.cooldown = check_cooldown(cooldown)
        self.target = None if target is None else check_target(target)

    def __repr__(self) -> str:
        return f"<Pool {self.name}>"

    # -- membership ---------------------------------------------------------------

    def _objects(self):
        return Resource.objects.using(self.using)

    def resources(self):
        """A QuerySet of the pool's `Resource` rows (one per slot), for listing. Judge their
        state with `Resource.state_at(leases.clock.db_now())`: by the database's clock,
        never this host's."""
        return self._objects().filter(pool=self.name)

    def add(self, name: str, data: Any = None, slots: int = 1) -> bool:
        """Add a resource that up to `slots` holders may lease at once, each with a lease
        (and token) of its own. Adding it again changes nothing but its data, if given,
        and its slots: fewer drops the highest, whose holders lose them at the next
        renewal. Returns True when the resource is new.
        """
        check_name(name, "resource name", RESOURCE_NAME_LENGTH)
        check_slots(slots)
        if data is not None:
            check_data(data)

        def attempt() -> bool:
            with transaction.atomic(using=self.using):
                rows = self._objects().select_for_update().filter(pool=self.name, name=name)
                have = {slot: data_ for slot, data_ in rows.values_list("slot", "data")}
                kept = have.get(0, {}) if data is None else data
                if data is not None and have:
                    rows.update(data=data)
                self._objects().bulk_create(
                    Resource(pool=self.name, name=name, slot=slot, data=kept) for slot in range(slots) if slot not in have
                )
                rows.filter(slot__gte=slots).delete()
            return not have

        def work(cursor: Any, resumed: bool) -> bool:
            # Two adds of one new resource race: the second to insert meets the first's
            # rows (a duplicate key), or on a Galera cluster is refused at COMMIT (1213,
            # retried by db.run); either way it does its add again, over those rows.
            try:
                return attempt()
            except IntegrityError:
                return attempt()

        return db.run(work, self.using)

    def add_many(
        self,
        items: Iterable[tuple[str, Any]],
        batch_size: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Add (name, data) pairs in one transaction: all of them or, on bad input, none.

        Existing names keep their lease state; their data is replaced where data is given.
        `progress` is called with the number of rows written after each batch.
        """
        rows = []
        for name, data in items:
            check_name(name, "resource name", RESOURCE_NAME_LENGTH)
            rows.append((name, check_data(data)))
        upsert = db.upsert(connections[self.using], ["pool", "name", "slot"], ["data"])

        told = 0  # rows reported to `progress`: an import done again (db.run) counts once

        def work(cursor: Any, resumed: bool) -> None:
            nonlocal told
            with transaction.atomic(using=self.using):
                for start in range(0, len(rows), batch_size):
                    batch = rows[start : start + batch_size]
                    with_data = [Resource(pool=self.name, name=n, data=d) for n, d in batch if d is not None]
                    bare = [Resource(pool=self.name, name=n) for n, d in batch if d is None]
                    objects = self._objects()
                    if with_data:
                        objects.bulk_create(with_data, **upsert)
                    if bare:
                        objects.bulk_create(bare, ignore_conflicts=True)
                    written = start + len(batch)
                    if progress and written > told:
                        progress(written - told)
                        told = written

        # Through db.run: a conflict at COMMIT (a Galera node's) does the import again.
        db.run(work, self.using)
        return len(rows)

    def remove(self, name: str) -> bool:
        """Delete a resource; a holder of it loses its lease at the next renewal."""
        deleted, _ = self.resources().filter(name=name).delete()
        return bool(deleted)

    # -- leasing --------------------------------------------------------------------

    def acquire(self, ttl: float = 60, wait: float = 0, holder: str | None = None, fair: bool = False,
                stop: threading.Event | None = None) -> Lease:
        """Lease one free slot for `ttl` seconds.

        With `wait` > 0, retry with jittered pauses until that many seconds have passed,
        riding out database outages as well as an exhausted pool; then raise the
        database's error if the last attempt got no answer, else NoResourceAvailable.
        A refused connection takes a few seconds to give up on, so the deadline can be
        overrun by that much. UnknownPool when the pool has no resources at all.

        With `fair=True` (and `wait`), callers that wait are served in the order they
        came: each takes a ticket and only the oldest live one tries, every 50 ms. It
        costs each waiter two statements a poll, and a slot freed waits for the next poll
        of the first in line; callers without `fair` are not held back.

        `holder` names you in the row (default host:pid; a random suffix is added, so it
        is unique per acquisition). Setting the `stop` event ends a wait at once
        (NoResourceAvailable): a process told to stop must not sit out the rest of it.
        Returns the `Lease`.
        """
        ttl = check_ttl(ttl)
        deadline = time.monotonic() + check_wait(wait)
        holder = make_holder(holder)
        in_doubt: list[_Claim] = []
        line = _Line(self, holder) if fair and wait else None
        answered = False
        attempt = 0
        try:
            while True:
                error: Exception | None = None
                try:
                    turn = line is None or line.first()
                    lease = (self._recover(in_doubt, holder, ttl) or self._try_acquire(
                        ttl, holder, first=not answered, in_doubt=in_doubt
                    )) if turn else None
                except Error as exc:
                    if not db.transient(exc):
                        raise
                    error = exc
                else:
                    if lease is not None:
                        return lease
                    answered = True
                left = deadline - time.monotonic()
                if left <= 0:
                    if error is not None:
                        raise error
                    waited = f" within {wait:g}s" if wait else ""
                    raise NoResourceAvailable(f"no free resource in pool {self.name!r}{waited}")
                if error is not None:
                    log.info("pool %r: database unavailable, retrying for %.1fs more: %s", self.name, left, error)
                pause = FAIR_POLL if line is not None and error is None else 0.05 + db.backoff(attempt, 0.05, 1.0)
                if stop is None:
                    time.sleep(min(left, pause))
                elif stop.wait(min(left, pause)):
                    raise NoResourceAvailable(f"stopped waiting for a free resource in pool {self.name!r}")
                attempt += 1
        finally:
            if line is not None:
                line.leave()

    def _try_acquire(self, ttl: float, holder: str, first: bool, in_doubt: list[_Claim]) -> Lease | None:
        for _ in range(ROUNDS):
            rows = db.run(self._candidates, self.using)
            mono_anchor = time.monotonic()
            if not rows:
                if first and not self._exists():
                    raise unknown_pool(self.name, self.using)
                return None
            rows = list(rows)
            random.shuffle(rows)  # racing acquirers read the same few: spread them
            for row in rows:
                claim = _Claim(tuple(row), mono_anchor, sent_at=time.monotonic())
                try:
                    won = db.run(self._claimer(claim.id, claim.token, holder, ttl), self.using)
                except Error as exc:
                    if db.transient(exc):  # the claim may have committed before the outage
                        in_doubt.append(claim)
                    raise
                if won is not None:
                    return self._lease(claim, won, holder, ttl)
        return None

    def _recover(self, in_doubt: list[_Claim], holder: str, ttl: float) -> Lease | None:
        """The lease of a claim whose outcome an outage hid, if it committed (or can still win).

        Without this look-up a claim that committed just before the database went away
        would keep its resource busy for the whole ttl while we lease another.
        """
        if not in_doubt:
            return None
        claim = in_doubt[0]
        claimer = self._claimer(claim.id, claim.token, holder, ttl)
        won = db.run(lambda cursor, resumed: claimer(cursor, True), self.using)
        in_doubt.clear()
        return self._lease(claim, won, holder, ttl) if won is not None else None

    def _lease(self, claim: _Claim, token: int, holder: str, ttl: float) -> Lease:
        """The lease a won claim gives: `token` is the one the claim wrote."""
        id_, _, name, data, now, slot = claim.row
        return Lease(
            pool=self.name,
            id=id_,
            name=name,
            resource=load_json(data),
            slot=slot,
            cooldown=self.cooldown,
            token=token,
            holder=holder,
            ttl=ttl,
            sent_at=claim.sent_at,  # the earliest the claim can have committed
            db_anchor=db.to_datetime(now),
            mono_anchor=claim.mono_anchor,
            using=self.using,
        )

    def _candidates(self, cursor: Any, resumed: bool) -> list:
        st = statements(cursor.db)
        if self.target is None:
            cursor.execute(st.candidates, (self.name, CANDIDATES))
        else:
            cursor.execute(st.candidates_for, (self.name, self.name, self.target, CANDIDATES))
        return cursor.fetchall()

    @staticmethod
    def _claimer(id_: int, token: int, holder: str, ttl: float) -> Callable[[Any, bool], int | None]:
        """The claim of the resource `id_` whose token was `token`: the token it holds now,
        or None when another holder won it."""
        def claim(cursor: Any, resumed: bool) -> int | None:
            st = statements(cursor.db)
            if resumed:  # the first try may have committed before the connection dropped
                cursor.execute(st.claimed, (id_, token, holder))
                row = cursor.fetchone()
                if row:
                    return row[0]
            floor = db.fence_floor(cursor.db)
            cursor.execute(st.claim, (db.dialect(cursor.db).seconds(ttl), holder, floor, id_, token))
            return max(token + 1, floor) if cursor.rowcount == 1 else None

        return claim

    def _exists(self) -> bool:
        def work(cursor: Any, resumed: bool) -> bool:
            cursor.execute(statements(cursor.db).exists, (self.name,))
            return cursor.fetchone() is not None

        return db.run(work, self.using)

    @contextmanager
    def lease(
        self,
        ttl: float = 60,
        wait: float = 0,
        holder: str | None = None,
        interval: float | None = None,
    ) -> Iterator[Lease]:
        """Hold a resource for the block, renewing it every `interval` (ttl/3) seconds.

        If renewal fails the block is not interrupted: `lease.lost` turns true and
        `lease.check()` raises LeaseLost, so long loops should call it between steps.
        """
        lease = self.acquire(ttl=ttl, wait=wait, holder=holder)
        heartbeat = Heartbeat(lease, interval)
        heartbeat.start()
        try:
            yield lease
        finally:
            heartbeat.stop()
            lease.release()

    # -- operators ------------------------------------------------------------------

    def _by_name(self, key: str, params: tuple, name: str) -> int:
        def work(cursor: Any, resumed: bool) -> int:
            cursor.execute(getattr(statements(cursor.db), key), params)
            return cursor.rowcount

        changed = db.run(work, self.using)
        if not changed and not self.resources().filter(name=name).exists():
            raise UnknownResource(f"no resource {name!r} in pool {self.name!r}")
        return changed

    def quarantine(self, name: str, seconds: float = 86400, reason: str = "") -> None:
        """Take a resource out of service for `seconds`; a current holder loses it."""
        seconds = check_ttl(seconds, "quarantine seconds")
        later = db.dialect(connections[self.using]).seconds(seconds)
        self._by_name("quarantine", (later, later, (reason or "")[:255], self.name, name), name)

    def unquarantine(self, name: str) -> bool:
        """Put a quarantined resource back in service. False if it was not quarantined."""
        return bool(self._by_name("unquarantine", (self.name, name), name))

    def release(self, name: str) -> bool:
        """Free a held resource whoever holds it (an operator's action). False if not held."""
        return bool(self._by_name("evict", (self.name, name), name))

    def stats(self) -> dict[str, int]:
        """Slots by the database clock: free, held, cooling (rested after a release),
        quarantined, total."""

        def work(cursor: Any, resumed: bool) -> tuple:
            cursor.execute(statements(cursor.db).stats, (self.name,))
            return cursor.fetchone()

        total, quarantined, held, cooling = (int(v) for v in db.run(work, self.using))
        return {"free": total - held - cooling - quarantined, "held": held, "cooling": cooling,
                "quarantined": quarantined, "total": total}
