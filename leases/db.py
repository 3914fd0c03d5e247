"""Everything that differs between database vendors, in one place.

The engine writes its statements once with a few placeholders taken from a `Dialect`:
the server clock (`now`), the server clock plus some seconds (`later`, one parameter),
and random order. Expiry is always computed inside the statement by the server, never
by the client, so a client with a wrong clock can neither steal nor lose a lease.

`run()` wraps one short unit of work: it retries deadlocks, lock-wait timeouts and
SQLite's "database is locked" with jittered backoff, reopens a dropped connection, and
waits out a refused one for a few seconds. Anything longer reaches the caller as
Django's OperationalError; `transient()` tells such an outage from a real error. Each
connection it sees die is noted in `leases.outages`, so that connections kept elsewhere
in the process (a worker's handler threads') are replaced before their next use.
"""
from __future__ import annotations

import logging
import random
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import Any, Callable, Iterator, TypeVar

from django.core.checks import Error, Warning
from django.db import Error as DatabaseError
from django.db import InterfaceError, InternalError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from . import conf, watchdog
from .outages import close, drop_if_broken, lost, one_line

log = logging.getLogger("leases.db")

T = TypeVar("T")

# MySQL/MariaDB error numbers (first element of the driver's exception args).
# Lock wait timeout, deadlock (and Galera's certification failure), and Group
# Replication's rollback of a conflicting transaction at COMMIT (InnoDB Cluster).
_RETRY_CODES = {1205, 1213, 3101}
# The connection died under a statement: server gone, lost connection (a read timeout
# too), idle disconnect, killed, server shutting down; or the node left its Galera
# cluster's primary component (1047, "WSREP has not yet prepared node"): a new
# connection through a proxy reaches a node that is in it.
_RECONNECT_CODES = {2006, 2013, 2055, 4031, 1927, 1053, 1047}
# No connection could be made: refused, no socket, unknown host, too many connections.
_UNREACHABLE_CODES = {2002, 2003, 2005, 1040}

# PostgreSQL's SQLSTATEs (the driver's error's `sqlstate`), in the same three kinds:
# serialization failure, deadlock, lock timeout; the server ended the session (an
# administrator, a crash, a failover) or the link broke; the server refused a new
# connection (starting up, too many connections, could not connect).
_PG_RETRY = {"40001", "40P01", "55P03"}
_PG_RECONNECT = {"57P01", "57P02", "08000", "08003", "08006", "08007"}
_PG_UNREACHABLE = {"57P03", "53300", "08001", "08004"}
#: A write on a server that takes none: after a switchover or a failover, a session that
#: still reaches the old primary (now a replica). A new connection finds the new primary.
_PG_READ_ONLY = "25006"
#: Words of psycopg's connection errors, which carry no SQLSTATE: the server is away, or
#: it answered and refused us (a wrong role, password or database: waiting cannot cure it).
_PG_REFUSED = ("connection failed", "connection refused", "could not connect", "timeout expired",
               "could not translate host name", "no such file or directory")
_PG_DENIED = ("does not exist", "authentication failed", "no pg_hba.conf entry", "permission denied")
#: The server answered and refused who we are or what we named: access denied to a
#: database or a user, an unknown database (MySQL); invalid authorization, a wrong
#: password, a database that does not exist (PostgreSQL).
_DENIED_CODES = {1044, 1045, 1049, 1698}
_PG_DENIED_STATES = {"28000", "28P01", "3D000"}


@dataclass(frozen=True)
class Dialect:
    """SQL fragments for one vendor. `later` takes one parameter built by `seconds()`."""

    vendor: str
    now: str
    later: str
    random: str
    seconds: Callable[[float], Any]
    #: Whether an upsert names its conflict columns (MySQL's ON DUPLICATE KEY cannot).
    conflict_target: bool
    #: Head of an upsert's update part; `{keys}` are the conflict columns.
    upsert: str
    #: How the update part refers to the value the INSERT tried to write.
    new: str
    #: Layout of datetimes as the database stores them, for parameters compared in SQL.
    stored_datetime: Callable[[datetime], Any]
    #: Whole steps of %s seconds from a moment (the first %s) to `{col}`, for columns at or
    #: after that moment (so truncating toward zero is the floor): a time axis's bars.
    steps: str
    #: Ends an INSERT whose new id is read back: PostgreSQL returns it as a row, the
    #: others through the cursor's lastrowid.
    returning: str = ""
    #: Tells listeners of a channel (first parameter) each payload of a list (the second)
    #: when the transaction commits; "" where the database has no notifications.
    notify: str = ""
    #: Whether a push writes its rows as one array per column (`insert_arrays`) rather
    #: than a VALUES group per row.
    arrays: bool = False
    #: A JSON text parameter where its type is not inferred from a column (a SELECT list
    #: feeding an INSERT): PostgreSQL takes such a parameter for text, not jsonb.
    json: str = "%s"
    #: The larger of two values (SQLite's two-argument MAX), for a fence's next value.
    greatest: str = "GREATEST"
    #: Reads the server's timeline, where a failover can promote a server that missed the
    #: last commits of the old one (PostgreSQL's asynchronous standbys); "" where none can.
    timeline: str = ""


_MYSQL = Dialect(
    vendor="mysql",
    # UTC_TIMESTAMP ignores the session time zone; Django stores UTC in DATETIME(6).
    now="UTC_TIMESTAMP(6)",
    later="(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)",
    random="RAND()",
    seconds=lambda s: int(round(s * 1_000_000)),
    conflict_target=False,
    upsert="ON DUPLICATE KEY UPDATE",
    new="VALUES({col})",
    stored_datetime=lambda dt: dt.astimezone(timezone.utc).replace(tzinfo=None),
    steps="FLOOR(TIMESTAMPDIFF(MICROSECOND, %s, {col}) / (%s * 1000000))",
)

_SQLITE = Dialect(
    vendor="sqlite",
    # Same text layout as Django's stored datetimes ('YYYY-MM-DD HH:MM:SS.ffffff'), so
    # comparisons between columns and the clock are plain string comparisons.
    now="strftime('%%Y-%%m-%%d %%H:%%M:%%f000', 'now')",
    later="strftime('%%Y-%%m-%%d %%H:%%M:%%f000', 'now', %s)",
    random="RANDOM()",
    seconds=lambda s: f"{s:+.3f} seconds",
    conflict_target=True,
    upsert="ON CONFLICT ({keys}) DO UPDATE SET",
    new="excluded.{col}",
    stored_datetime=lambda dt: dt.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f"),
    steps="CAST((julianday({col}) - julianday(%s)) * 86400 / %s AS INTEGER)",
    greatest="MAX",
)

_POSTGRES = Dialect(
    vendor="postgresql",
    # now() is the transaction's start, frozen for its whole life: a long transaction
    # would hand out a lease that expired meanwhile. statement_timestamp() is read afresh
    # for each statement and, like MySQL's clock, is one moment for all its rows
    # (clock_timestamp() would stamp each row of one UPDATE differently).
    now="statement_timestamp()",
    later="(statement_timestamp() + %s * INTERVAL '1 microsecond')",
    random="random()",
    seconds=lambda s: int(round(s * 1_000_000)),
    conflict_target=True,
    upsert="ON CONFLICT ({keys}) DO UPDATE SET",
    new="EXCLUDED.{col}",
    # timestamptz columns: an aware datetime is compared as the instant it is.
    stored_datetime=lambda dt: dt.astimezone(timezone.utc),
    steps="FLOOR(EXTRACT(EPOCH FROM ({col} - %s)) / %s)",
    returning=" RETURNING id",
    notify="SELECT pg_notify(%s, payload) FROM unnest(%s::text[]) AS payload",
    arrays=True,
    json="%s::jsonb",
    # The timeline is the first eight hex digits of the current WAL file's name; every
    # promotion starts a higher one. Any role may call both functions.
    timeline="SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint",
)

DIALECTS = {"mysql": _MYSQL, "sqlite": _SQLITE, "postgresql": _POSTGRES}


def alias(using: str | None = None) -> str:
    """The database alias the engine works on: `using`, else settings.LEASES_DATABASE."""
    return using or conf.database()


def dialect(connection: BaseDatabaseWrapper) -> Dialect:
    try:
        return DIALECTS[connection.vendor]
    except KeyError:
        raise NotImplementedError(
            f"django-leases supports MySQL/MariaDB, PostgreSQL and SQLite, not {connection.vendor!r}"
        ) from None


def fence_floor(connection: BaseDatabaseWrapper, bits: int = 32) -> int:
    """The least value a fencing token (or a job's claim count, `bits=20`) may take next
    on this connection's server: 0 until a failover, then above any value the old server
    can have handed out, so a grant whose commit the failover lost is never granted again
    under the same number. Read once per connection: a session never outlives a promotion.
    """
    sql = dialect(connection).timeline
    if not sql:
        return 0
    raw = connection.connection
    known = getattr(connection, "_leases_timeline", None)
    if known is None or known[0] is not raw:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            known = (connection.connection, int(cursor.fetchone()[0]))
        connection._leases_timeline = known
    return (known[1] - 1) << bits


def upsert(connection: BaseDatabaseWrapper, unique_fields: list[str], update_fields: list[str]) -> dict:
    """bulk_create() arguments that update `update_fields` where a row already exists."""
    target = {"unique_fields": unique_fields} if dialect(connection).conflict_target else {}
    return {"update_conflicts": True, "update_fields": update_fields, **target}


def supported(vendor: str) -> bool:
    return vendor in DIALECTS


def to_datetime(value: Any) -> datetime:
    """A naive UTC value read back from a raw cursor, as an aware datetime."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value


def _kind(exc: BaseException) -> str | None:
    """retry (same connection), reconnect (it died mid-statement), unreachable, or None."""
    sqlstate = getattr(exc.__cause__, "sqlstate", False)
    if isinstance(exc, InternalError) and sqlstate == _PG_READ_ONLY:
        return "unreachable"  # nothing was written; wait for the primary as for a restart
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return None
    if sqlstate is not False:  # psycopg's error, which Django's wraps
        return _pg_kind(exc, sqlstate)
    code = exc.args[0] if exc.args else None
    if code in _RETRY_CODES:
        return "retry"
    if code in _RECONNECT_CODES:
        return "reconnect"
    if code in _UNREACHABLE_CODES:
        return "unreachable"
    if isinstance(exc, InterfaceError):  # the driver's "(0, '')": a connection already closed
        return "reconnect"
    if "database is locked" in str(exc) or "database table is locked" in str(exc):
        return "retry"
    return None


def _pg_kind(exc: BaseException, sqlstate: str | None) -> str | None:
    if sqlstate in _PG_RETRY:
        return "retry"
    if sqlstate in _PG_RECONNECT:
        return "reconnect"
    if sqlstate in _PG_UNREACHABLE:
        return "unreachable"
    if sqlstate is None:  # a connection error: refused, or a link that broke under a statement
        text = str(exc).lower()
        if any(words in text for words in _PG_DENIED):
            return None
        return "unreachable" if any(words in text for words in _PG_REFUSED) else "reconnect"
    return None


def _label(exc: BaseException, kind: str) -> str:
    """How a retried error is counted in the log: 1213 is a deadlock, or on Galera a
    certification conflict at COMMIT."""
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) and exc.args[0] else None
    code = code or getattr(exc.__cause__, "sqlstate", None)
    named = {1213: "deadlock or certification conflict", 1205: "lock wait timeout", "40P01": "deadlock",
             "40001": "serialization failure", "55P03": "lock timeout"}
    return f"{named.get(code, kind)} ({code})" if code else ("database is locked" if kind == "retry" else kind)


def transient(exc: BaseException) -> bool:
    """Whether `exc` is an outage or a lost race (worth waiting out), not a wrong statement."""
    return _kind(exc) is not None


def denied(exc: BaseException) -> bool:
    """Whether `exc` is the server refusing the connection's settings (a wrong database
    name, user or password; SQLite: a file it cannot open): bad input, not an outage."""
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    cause = exc.__cause__
    if hasattr(cause, "sqlstate"):  # psycopg: a refused connection carries words, not a state
        return cause.sqlstate in _PG_DENIED_STATES or (
            cause.sqlstate is None and any(words in str(exc).lower() for words in _PG_DENIED))
    if exc.args and exc.args[0] in _DENIED_CODES:
        return True
    return "unable to open database file" in str(exc)


def backoff(attempt: int, base: float = 0.02, cap: float = 1.0) -> float:
    """Full-jitter exponential backoff: a random pause in [0, min(cap, base * 2**attempt))."""
    return random.uniform(0, min(cap, base * (2**attempt)))


_QMARK = re.compile(r"(?<!%)%s")


@lru_cache(maxsize=1024)
def _qmark(sql: str) -> str:
    """Django's format-style SQL in sqlite3's qmark style, converted once per statement."""
    return _QMARK.sub("?", sql).replace("%%", "%")


class Cursor:
    """The driver's own cursor, with Django's error translation and placeholder style.

    The engine's statements are short and many; Django's cursor wrapper costs tens of
    microseconds each (a new wrapper, execute wrappers, SQLite's per-call placeholder
    rewrite), which bench/leases.py showed as a fifth of an acquire+release pair. Errors
    still surface as django.db exceptions, so `run()` and callers catch the usual types.
    Query logging under DEBUG and execute_wrappers do not see these statements.
    """

    __slots__ = ("db", "_cursor", "_convert")

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.db = connection
        with connection.wrap_database_errors:  # psycopg refuses a cursor on a closed connection
            self._cursor = connection.connection.cursor()
        self._convert = _qmark if connection.vendor == "sqlite" else str

    def execute(self, sql: str, params: tuple | list = ()) -> None:
        with self.db.wrap_database_errors:
            self._cursor.execute(self._convert(sql), tuple(params))

    def fetchone(self) -> Any:
        with self.db.wrap_database_errors:  # sqlite3 steps the statement while fetching
            return self._cursor.fetchone()

    def fetchall(self) -> list:
        with self.db.wrap_database_errors:
            return list(self._cursor.fetchall())

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int:
        """The id of the row the last INSERT made (its statement ends with {returning})."""
        if dialect(self.db).returning:
            return self.fetchone()[0]
        return self._cursor.lastrowid

    def close(self) -> None:
        """Close quietly: after a failed statement or COMMIT the driver's close raises an
        error of its own (untranslated), which must never replace the one that matters."""
        try:
            self._cursor.close()
        except Exception as exc:  # noqa: BLE001 - the connection is closed or reopened by run()
            log.debug("closing a cursor failed: %s", one_line(exc))


def run(
    work: Callable[[Any, bool], T],
    using: str | None = None,
    attempts: int = 8,
    until: float | None = None,
) -> T:
    """Run `work(cursor, resumed)` and retry it on transient errors.

    `resumed` is true when an earlier attempt lost its connection after it began, so its
    outcome is unknown: the statement may have committed. That includes a refused
    connection inside the work: Django reconnects as a transaction whose COMMIT reply was
    lost ends, and that error replaces the COMMIT's. Work that is not idempotent checks first.
    A refused connection is retried with longer pauses (4 to 9 s in all) than a lost
    race. Inside a caller's transaction nothing is retried: the transaction is already lost.

    Each retry is a DEBUG line; work that succeeded after retries says so in one INFO line
    (how many, of which kinds), and work that ran out of attempts raises the last error,
    so a one-shot command still reports an outage in one line. An attempt that waits for
    the server past its deadline (`leases.watchdog`: LEASES_READ_TIMEOUT, or `until`, a
    `time.monotonic()` moment after which the work is worthless) fails as a lost connection.
    """
    connection = connections[alias(using)]
    resumed = False
    kinds: list[str] = []
    for attempt in range(attempts):
        sent = False
        watch = None
        try:
            drop_if_broken(connection)
            connection.ensure_connection()
            watch = watchdog.watch(connection, until)
            cursor = Cursor(connection)
            try:
                sent = True
                result = work(cursor, resumed)
            finally:
                cursor.close()
                watchdog.done(watch)
            if kinds:
                log.info("transient database errors retried on %s: %s, then it went through", connection.alias,
                         ", ".join(f"{kind} x{kinds.count(kind)}" for kind in dict.fromkeys(kinds)))
            return result
        except (OperationalError, InterfaceError, InternalError) as exc:
            kind = _kind(exc)
            watchdog.done(watch)
            if kind is None or connection.in_atomic_block or attempt == attempts - 1 or watchdog.late(until):
                raise
            kinds.append(_label(exc, kind))
            log.debug("transient database error (%s), attempt %d of %d: %s", kind, attempt + 1, attempts, exc)
            if kind != "retry":  # the connection died, or a new one was refused
                close(connection)
                lost(connection.alias)
                resumed = resumed or sent
            if kind == "unreachable":  # a server restarting: pause longer, never next to nothing
                step = min(2.0, 0.1 * 2**attempt)
                time.sleep(step / 2 + random.uniform(0, step / 2))
            else:
                time.sleep(backoff(attempt))
    raise AssertionError("unreachable")


def listen(connection: BaseDatabaseWrapper, channel: str) -> bool:
    """Subscribe `connection` (autocommit, used for nothing else) to `channel`; False
    where the database or its driver has no notifications (psycopg 3 has them)."""
    if not dialect(connection).notify:
        return False
    connection.ensure_connection()
    raw = connection.connection
    if not callable(getattr(raw, "notifies", None)):  # psycopg2's is a list
        return False
    with connection.wrap_database_errors:
        raw.execute(f"LISTEN {connection.ops.quote_name(channel)}")
    return True


def notifications(connection: BaseDatabaseWrapper, timeout: float) -> list[str]:
    """Payloads that reached a listening connection: as soon as some come, or [] after
    `timeout` seconds. A broken connection raises Django's OperationalError."""
    with connection.wrap_database_errors:
        return [note.payload for note in connection.connection.notifies(timeout=timeout, stop_after=1)]


def driver_errors(using: str | None = None) -> tuple[type[BaseException], ...]:
    """Django's database error and the driver's own: what a long-running loop survives,
    should an error of the driver ever escape Django's wrapping."""
    return DatabaseError, connections[alias(using)].Database.Error


def table(model: Any, connection: BaseDatabaseWrapper) -> str:
    """The model's table name, quoted for this connection (identifiers, never values)."""
    return connection.ops.quote_name(model._meta.db_table)


def skip_locked(connection: BaseDatabaseWrapper) -> str:
    """Suffix of a claiming SELECT: skip rows another transaction holds, where supported.

    MySQL 8.0.1+ and MariaDB 10.6+ have it. SQLite has no row locks: its claims run in
    an immediate transaction (`write_transaction`), which admits one writer at a time.
    """
    return " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""


def for_update(connection: BaseDatabaseWrapper) -> str:
    """Suffix of a SELECT whose rows the transaction will change: lock them where there
    are row locks (SQLite's immediate transaction already excludes other writers)."""
    return " FOR UPDATE" if connection.features.has_select_for_update else ""


@contextmanager
def write_transaction(using: str | None = None) -> Iterator[None]:
    """A transaction that will write: on SQLite it takes the write lock at BEGIN.

    A deferred SQLite transaction that reads first and writes later fails with "database
    is locked" when another writer got in between; BEGIN IMMEDIATE waits for the lock
    (busy timeout) instead. On MySQL an outermost one is started with one statement
    (`_started`); elsewhere, and inside a caller's transaction, this is `transaction.atomic()`.
    """
    connection = connections[alias(using)]
    if connection.vendor == "mysql" and not connection.in_atomic_block and connection.get_autocommit():
        with _started(connection):
            yield
        return
    immediate = connection.vendor == "sqlite" and not connection.in_atomic_block
    previous = getattr(connection, "transaction_mode", None)
    if immediate:
        connection.transaction_mode = "IMMEDIATE"  # read by atomic() when it sends BEGIN
    try:
        with transaction.atomic(using=connection.alias):
            if immediate:
                connection.transaction_mode = previous
            yield
    finally:
        if immediate:
            connection.transaction_mode = previous


@contextmanager
def _started(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """An outermost transaction on MySQL: START TRANSACTION ... COMMIT, the session left in
    autocommit. `atomic()` switches autocommit off before and on after, a server round trip
    each way: with the COMMIT, three for the two a transaction needs, which a worker pays
    at every claim and every batch of outcomes.

    Django is told what `atomic()` would tell it (in an atomic block, not autocommitting),
    so a nested `atomic()` makes a savepoint, `on_commit` waits for the COMMIT, `run()`
    does not retry inside, and a connection closed inside is dropped at the end."""
    connection.ensure_connection()
    with connection.wrap_database_errors:
        connection.connection.query("START TRANSACTION")
    connection.in_atomic_block, connection.autocommit = True, False
    connection.commit_on_exit, connection.needs_rollback = True, False
    committed = False
    try:
        yield
        if not connection.needs_rollback:
            with connection.wrap_database_errors:
                connection.connection.commit()
            committed = True
    finally:
        connection.in_atomic_block, connection.autocommit = False, True
        if not committed:
            _roll_back(connection)
        connection.needs_rollback = False
        if connection.closed_in_transaction:  # as atomic() does: the server rolled back
            connection.closed_in_transaction = False
            connection.connection = None
    connection.errors_occurred = False
    connection.run_and_clear_commit_hooks()


def _roll_back(connection: BaseDatabaseWrapper) -> None:
    """Roll back a failed transaction; a connection that cannot is dropped (the server
    rolls back what a closed session left)."""
    connection.run_on_commit = []
    if connection.connection is None or connection.closed_in_transaction:
        return
    try:
        with connection.wrap_database_errors:
            connection.connection.rollback()
    except Exception as exc:  # noqa: BLE001 - the error that matters is the caller's
        log.debug("rolling back failed, dropping the connection: %s", one_line(exc))
        close(connection)


def answers(using: str | None = None) -> bool:
    """Whether the database answers a trivial query now (two quick tries): tells an outage
    from a statement the database refused."""
    try:
        run(lambda cursor, resumed: cursor.execute("SELECT 1"), using, attempts=2)
    except DatabaseError:
        return False
    return True


def check_databases(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """The connection the engine uses: a vendor it supports, UTC, and timeouts that turn a
    stalled server into an error the engine retries (a system check)."""
    alias = conf.database()
    if alias not in connections:
        return []  # leases.E002, from leases.conf
    connection = connections[alias]
    if not supported(connection.vendor):
        return [Error(f"django-leases supports MySQL/MariaDB, PostgreSQL and SQLite, not {connection.vendor}.",
                      id="leases.E003")]
    errors: list[Error] = []
    options = connection.settings_dict.get("OPTIONS") or {}
    if connection.vendor == "mysql" and not options.get("read_timeout"):
        errors.append(Warning(
            f"DATABASES[{alias!r}]['OPTIONS'] sets no read_timeout: a stalled database server "
            "hangs workers and heartbeats until it wakes up.",
            hint="Set connect_timeout, read_timeout and write_timeout (e.g. 5, 30, 30 seconds).",
            id="leases.W001",
        ))
    if connection.settings_dict.get("TIME_ZONE") not in (None, "UTC"):
        errors.append(Error(f"DATABASES[{alias!r}]['TIME_ZONE'] must be unset or 'UTC'.", id="leases.E004"))
    return errors
