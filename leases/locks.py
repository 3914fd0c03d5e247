"""Named SQL mutexes with an expiry and owner-checked release.

The same engine as resource leases: the server clock decides expiry, one conditional
statement decides each race, a token identifies the holder and only grows. Unlike the
Redis design this replaces (`SET NX EX` and a blind `DEL`), a holder whose lock expired
and passed to someone else can neither release nor extend the new holder's lock.
"""
from __future__ import annotations

import functools
import inspect
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from django.db import IntegrityError

from . import db
from .exceptions import Locked
from .lease import Hold, make_holder
from .models import Lock
from .sql import statements
from .validation import check_name, check_ttl, check_wait

F = TypeVar("F", bound=Callable[..., Any])

NAME_LENGTH = Lock._meta.get_field("name").max_length


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

    Raises Locked("PROCESSING LOCKED: name") when it stays held by someone else.
    """
    check_name(name, "lock name", NAME_LENGTH)
    ttl = check_ttl(ttl)
    deadline = time.monotonic() + check_wait(wait)
    holder = make_holder(holder)
    using = db.alias(using)
    attempt = 0
    while True:
        held = db.run(_attempt(name, ttl, holder, using), using)
        if held is not None:
            return held
        left = deadline - time.monotonic()
        if left <= 0:
            raise Locked(f"PROCESSING LOCKED: {name}")
        time.sleep(min(left, 0.02 + db.backoff(attempt, base=0.02, cap=0.5)))
        attempt += 1


def _attempt(name: str, ttl: float, holder: str, using: str) -> Callable[[Any, bool], HeldLock | None]:
    def work(cursor: Any, resumed: bool) -> HeldLock | None:
        st = statements(cursor.db, "lock")
        seconds = db.dialect(cursor.db).seconds(ttl)
        cursor.execute(st.read, (name,))
        row = cursor.fetchone()
        mono_anchor = time.monotonic()
        if row is None:  # first use of this name: create it, held
            sent_at = time.monotonic()
            try:
                cursor.execute(st.insert, (name, holder, seconds))
            except IntegrityError:
                return None  # someone else created it first
            id_, token = cursor.lastrowid, 1
            cursor.execute(statements(cursor.db).now, ())
            now, mono_anchor = cursor.fetchone()[0], time.monotonic()
            return _held(name, id_, token, holder, ttl, sent_at, now, mono_anchor, using)
        id_, token, current, expired, now = row
        if resumed and current == holder and not expired:
            # Our claim committed before the connection dropped; renew it to know its expiry.
            sent_at = time.monotonic()
            cursor.execute(st.renew, (seconds, id_, token, holder))
            if cursor.rowcount == 1:
                return _held(name, id_, token, holder, ttl, sent_at, now, mono_anchor, using)
        if not expired:
            return None
        sent_at = time.monotonic()
        cursor.execute(st.claim, (holder, seconds, id_, token))
        if cursor.rowcount != 1:
            return None
        return _held(name, id_, token + 1, holder, ttl, sent_at, now, mono_anchor, using)

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
    name: str, ttl: float = 60, wait: float = 0, holder: str | None = None, using: str | None = None
) -> Iterator[HeldLock]:
    """Hold the lock `name` for the block; released on exit if it is still ours."""
    held = acquire_lock(name, ttl=ttl, wait=wait, holder=holder, using=using)
    try:
        yield held
    finally:
        held.release()


def break_lock(name: str, using: str | None = None) -> bool:
    """Free a held lock whoever holds it (an operator's action). False if it was not held."""

    def work(cursor: Any, resumed: bool) -> bool:
        cursor.execute(statements(cursor.db, "lock").evict, (name,))
        return cursor.rowcount == 1

    return db.run(work, using)


def synchronized(
    prefix: str, arg: int | str | None = None, ttl: float = 60, wait: float = 0
) -> Callable[[F], F]:
    """Run the decorated function under the lock `prefix + str(<argument>)`.

    `arg` picks the argument that completes the key: an int is a position, a str a
    parameter name (passed by position or keyword); None uses `prefix` alone. Raises
    Locked("PROCESSING LOCKED: key") when the lock is held beyond `wait` seconds.
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
            with lock(key(args, kwargs), ttl=ttl, wait=wait):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
