"""The database server's clock: the only clock that decides expiry, read in one place.

Every expiry is computed inside the statements by the server (`{now}` and `{later}` of
`leases.db`); when Python needs the time too (an operator's page, a schedule's next tick,
a rate's window) it reads it here, from the same server, never from the local host.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from . import db
from .sql import statements


def now(cursor: Any) -> datetime:
    """The server's clock, read on `cursor` (in the caller's transaction)."""
    cursor.execute(statements(cursor.db, "clock").now, ())
    return db.to_datetime(cursor.fetchone()[0])


def db_now(using: str | None = None) -> datetime:
    """The server's clock of database `using` (LEASES_DATABASE by default)."""
    return db.run(lambda cursor, resumed: now(cursor), using)
