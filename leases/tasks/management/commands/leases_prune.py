"""`manage.py leases_prune --older-than 7d`: delete finished jobs (and their errors) in batches,
the rows of queue workers gone that long, and what targets said of resources (bans, rests,
paces) that ended that long ago, with the lines of their log (who said what) as old.

Ready and running jobs are never touched. Exit 2 on a bad duration or batch size, 75 when
the database is unavailable.
"""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from leases import routing, targets
from leases.durations import parse_duration
from leases.management.base import LeasesCommand
from leases.tasks.jobs.history import prune
from leases.tasks.jobs.recovery import forget_workers


class Command(LeasesCommand):
    help = ("Delete jobs that finished (succeeded, failed, dead, cancelled) longer ago than --older-than, "
            "and queue workers gone that long. Exit codes: 0 done, 2 bad input (nothing deleted), 75 the "
            "database is unavailable.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, help="with a unit: 12h, 7d (finished before now minus this)")
        parser.add_argument("--batch-size", type=int, default=1000, help="jobs deleted per transaction (default 1000)")
        parser.add_argument("--database", help="prune this database alias only (default: every one in use)")

    def handle(self, *args: Any, older_than: str, batch_size: int, **options: Any) -> None:
        try:
            seconds = parse_duration(older_than, unit=True)
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}", returncode=2) from None
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1", returncode=2)
        total = 0

        def progress(count: int) -> None:
            nonlocal total
            total += count
            if options["verbosity"] > 1:
                self.stderr.write(f"deleted {total} jobs so far")

        aliases = [routing.known(options["database"])] if options["database"] else routing.aliases()
        deleted = sum(prune(seconds, batch_size=batch_size, using=alias, progress=progress) for alias in aliases)
        workers = sum(forget_workers(seconds, alias) for alias in aliases)
        verdicts = sum(targets.forget(alias, seconds) for alias in aliases)
        if options["verbosity"] > 0:
            self.stdout.write(f"deleted {deleted} finished jobs, {workers} stopped workers and {verdicts} targets'"
                              f" past bans, rests and paces older than {older_than}")
