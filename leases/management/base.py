"""What every command of this app shares: one-line errors and the exit codes scripts test.

Exit codes: 2 bad input (nothing written), 75 (EX_TEMPFAIL) worth trying again later:
the database is unreachable or stayed busy, no resource was free, a lock was held.
"""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import Error

from leases import db

EX_USAGE = 2
EX_TEMPFAIL = 75


class LeasesCommand(BaseCommand):
    """A command whose bad input exits 2 and whose database outage exits 75, each with one
    line on stderr instead of a traceback."""

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute(*args, **options)
        except ValueError as exc:
            raise CommandError(str(exc), returncode=EX_USAGE) from None
        except Error as exc:
            if not db.transient(exc):
                raise
            raise CommandError(f"database unavailable, try again later: {exc}", returncode=EX_TEMPFAIL) from None
