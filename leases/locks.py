"""Named SQL mutexes with an expiry and owner-checked release.

The same engine as resource leases: the server clock decides expiry, one conditional
statement decides each race, a token identifies the holder and only grows. Unlike the
Redis design this replaces (`SET NX EX` and a blind `DEL`), a holder whose lock expired
and passed to someone else can neither release nor extend the new holder's lock.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from django.db import IntegrityError

from . import clock, db, routing
from .exceptions import LeaseLost, Locked
from .lease import Heartbeat, Hold, make_holder
from .models import Lock
from .sql import statements
from .validation import check_name, check_ttl, check_wait

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("leases")

NAME_LENGTH = Lock._meta.get_field("name").max_length


class _Busy(NamedTuple):
    """Who held the lock when we tried, and for how many more seconds (server clock)."""

    holder: str
    left: float


class HeldLock(Hold):
    """A lock you hold: `token`, `extend(ttl)`, `release()`, `remaining()`."""

    kind = "lock"

    def __init__(self, *, name: str, **hold: Any) -> None:
        super().__init__(**hold)
        self.name = name

    def __str__(self) -> str:
        return f"lock {self.name}"

    def extend(self, ttl: float | None = None) -> None:
        """Hold the lock `ttl` more seconds from now; LeaseLost if it already expired."""
        self.renew(ttl)


def acquire_lock(
    name: str, ttl: float = 60, wait: float = 0, holder: str | None = None, using: str | None = None
) -> HeldLock:
    """Take the lock `name` for `ttl` seconds, waiting up to `wait` seconds for it.

    Raises Locked("PROCESSING LOCKED: name (held by H for Ns more)") when it stays held by
    someone else.
    """
    check_name(name, "lock name", NAME_LENGTH)
    ttl = check_ttl(ttl)
    deadline = time.monotonic() + check_wait(wait)
    holder = make_holder(holder)
    using = routing.route("locks", name, using)
    attempt = 0
    while True:
        held = db.run(_attempt(name, ttl, holder, using), using)
        if isinstance(held, HeldLock):
            return held
        left = deadline - time.monotonic()
        if left <= 0:
            busy = f" (held by {held.holder} for {held.left:.1f}s more)" if held else ""
            raise Locked(f"PROCESSING LOCKED: {name}{busy}", name, *(held or ("", None)))
        time.sleep(min(left, 0.02 + db.backoff(attempt, base=0.02, cap=0.5)))
        attempt += 1


def _attempt(name: str, ttl: float, holder: str, using: str) -> Callable[[Any, bool], HeldLock | _Busy | None]:
    """One try: the lock, or who holds it (None when another taker won a race just now)."""

    def work(cursor: Any, resumed: bool) -> HeldLock | _Busy | None:
        st = statements(cursor.db, "lock")
        seconds = db.dialect(cursor.db).seconds(ttl)
        cursor.execute(st.read, (name,))
        row = cursor.fetchone()
        mono_anchor = time.monotonic()
        if row is None:  # first use of this name: create it, held
            sent_at = time.monotonic()
            token = max(1, db.fence_floor(cursor.db))
            try:
                cursor.execute(st.insert, (name, holder, token, seconds))
            except IntegrityError:
                return None  # someone else created it first
            id_ = cursor.lastrowid
            now, mono_anchor = clock.now(cursor), time.monotonic()
            return _held(name, id_, token, holder, ttl, sent_at, now, mono_anchor, using)
        id_, token, current, expired, now, expires_at = row
        if resumed and current == holder and not expired:
            # Our claim committed before the connection dropped; renew it to know its expiry.
            sent_at = time.monotonic()
            cursor.execute(st.renew, (seconds, id_, token, holder))
            if cursor.rowcount == 1:
                return _held(name, id_, token, holder, ttl, sent_at, now, mono_anchor, using)
        if not expired:
            return _Busy(current, (db.to_datetime(expires_at) - db.to_datetime(now)).total_seconds())
        sent_at = time.monotonic()
        floor = db.fence_floor(cursor.db)
        cursor.execute(st.claim, (holder, floor, seconds, id_, token))
        if cursor.rowcount != 1:
            return None
        return _held(name, id_, max(token + 1, floor), holder, ttl, sent_at, now, mono_anchor, using)

    return work


def _held(name, id_, token, holder, ttl, sent_at, now, mono_anchor, using) -> HeldLock:
    return HeldLock(
        name=name,
        id=id_,
        token=token,
        holder=holder,
        ttl=ttl,
        sent_at=sent_at,
        db_anchor=db.to_datetime(now),
        mono_anchor=mono_anchor,
        using=using,
    )


@contextmanager
def lock(
    name: str,
    ttl: float = 60,
    wait: float = 0,
    holder: str | None = None,
    using: str | None = None,
    keep_alive: bool = False,
) -> Iterator[HeldLock]:
    """Hold the lock `name` for the block; released on exit if it is still ours.

    With `keep_alive` a heartbeat thread renews it every ttl/3 seconds, so the block may
    outlast `ttl` (and the lock still frees itself ttl seconds after this process dies).
    If the lock expired inside the block and someone else took it meanwhile, or an operator
    broke it, the block was not exclusive: leaving it then raises LeaseLost (or, when the
    block raised, logs a warning beside that error). A lock that expired but was taken by
    no one (its token did not move) leaves quietly: nothing was shared.
    """
    held = acquire_lock(name, ttl=ttl, wait=wait, holder=holder, using=using)
    heartbeat = Heartbeat(held) if keep_alive else None
    if heartbeat is not None:
        heartbeat.start()
    failed = True
    try:
        yield held
        failed = False
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if not held.released and not held.release():  # released inside the block: fine
            why = f"{held} (token {held.token}) expired or was broken inside its block"
            if not failed:
                raise LeaseLost(f"{why}: someone else may have held it meanwhile")
            log.warning("%s", why)


def break_lock(name: str, using: str | None = None) -> bool:
    """Free a held lock whoever holds it (an operator's action). False if it was not held."""

    def work(cursor: Any, resumed: bool) -> bool:
        cursor.execute(statements(cursor.db, "lock").evict, (name,))
        return cursor.rowcount == 1

    return db.run(work, routing.route("locks", name, using))


def synchronized(
    prefix: str, arg: int | str | None = None, ttl: float = 60, wait: float = 0, keep_alive: bool = False
) -> Callable[[F], F]:
    """Run the decorated function under the lock `prefix + str(<argument>)`.

    `arg` picks the argument that completes the key: an int is a position, a str a
    parameter name (passed by position or keyword); None uses `prefix` alone. Raises
    Locked("PROCESSING LOCKED: key ...") when the lock is held beyond `wait` seconds;
    `keep_alive` as for `lock`.
    """
    check_ttl(ttl)
    check_wait(wait)

    def decorate(func: F) -> F:
        signature = inspect.signature(func)

        def key(args: tuple, kwargs: dict) -> str:
            if arg is None:
                return prefix
            if isinstance(arg, int):
                return prefix + str(args[arg])
            return prefix + str(signature.bind(*args, **kwargs).arguments[arg])

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lock(key(args, kwargs), ttl=ttl, wait=wait, keep_alive=keep_alive):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
