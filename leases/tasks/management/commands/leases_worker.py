"""`manage.py leases_worker`: run queued jobs, as many at once as `--concurrency`.

SIGTERM or SIGINT stops claiming and lets running jobs finish within `--grace` seconds,
then hands the rest back to the queue; a second signal exits at once (the jobs it ran
are recovered by other workers when its heartbeat lapses). A database outage is waited
out, at start as in the middle of work. Exit 2 on bad arguments.
"""
from __future__ import annotations

import signal
from importlib import import_module
from typing import Any

from django.core.management.base import CommandError, CommandParser

from leases.management.base import EX_USAGE, LeasesCommand
from leases.tasks import queue as jobqueue
from leases.tasks.worker import MIN_TTL, Worker
from leases.validation import check_seconds

#: Upper bounds that keep a typo from making a worker that never polls or never exits.
MAX_POLL = 60.0
MAX_CONCURRENCY = 1000


def _seconds(text: str, what: str, minimum: float = 0.0, above: bool = True, maximum: float | None = None) -> float:
    """Seconds within bounds, checked here rather than by argparse, whose errors come
    with the whole usage text instead of one line."""
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"{what} must be a number of seconds, not {text!r}", returncode=EX_USAGE) from None
    bounds = {"maximum": maximum} if maximum is not None else {}
    return check_seconds(value, what, minimum=minimum, above=above, **bounds)


class Command(LeasesCommand):
    help = "Run jobs of the delayed queue (and Django Tasks of the leases backend)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", default="default", help="queues to serve, comma-separated, or * (default: default)")
        parser.add_argument("--concurrency", type=int, default=4, help="jobs run at once, in threads (default 4)")
        parser.add_argument("--poll", default="0.05", help="seconds between polls while idle (default 0.05)")
        parser.add_argument("--ttl", default="30", help=f"heartbeat lease in seconds, at least {MIN_TTL:g} (default 30)")
        parser.add_argument("--grace", default="25", help="seconds running jobs get to finish on SIGTERM (default 25)")
        parser.add_argument("--burst", action="store_true", help="exit when nothing is ready (after retries due within a minute)")
        parser.add_argument("--max-jobs", type=int, default=None, help="exit after claiming this many jobs")
        parser.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers (repeatable)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        poll = _seconds(options["poll"], "--poll", maximum=MAX_POLL)
        ttl = _seconds(options["ttl"], "--ttl", minimum=MIN_TTL, above=False)
        grace = _seconds(options["grace"], "--grace", above=False)
        for module in options["imports"]:
            try:
                import_module(module)
            except Exception as exc:  # noqa: BLE001 - a syntax error too is the operator's input
                detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
                raise CommandError(f"--import {module}: {detail}", returncode=EX_USAGE) from None
        if not 1 <= options["concurrency"] <= MAX_CONCURRENCY:
            raise CommandError(f"--concurrency must be at least 1 and at most {MAX_CONCURRENCY}", returncode=EX_USAGE)
        if options["max_jobs"] is not None and options["max_jobs"] < 1:
            raise CommandError("--max-jobs must be at least 1", returncode=EX_USAGE)
        names = [name.strip() for name in options["queue"].split(",") if name.strip()]
        if not names:
            raise CommandError("--queue names no queue", returncode=EX_USAGE)
        worker = Worker(
            queues=names,
            concurrency=options["concurrency"],
            poll=poll,
            ttl=ttl,
            burst=options["burst"],
            max_jobs=options["max_jobs"],
            grace=grace,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
        if names != ["*"]:
            known = worker.when_up(jobqueue.known_queues)
            if known is None:
                return  # stopped while waiting for the database
            unknown = sorted(set(names) - known)
            if "*" in names or unknown:
                raise CommandError(
                    f"unknown queue(s): {', '.join(unknown or ['*'])} (known: {', '.join(sorted(known)) or 'none'})",
                    returncode=EX_USAGE,
                )
        stats = worker.run()
        if options["verbosity"] > 0:
            self.stderr.write(
                f"worker {worker.name}: {stats.claimed} claimed, {stats.succeeded} succeeded, "
                f"{stats.failed} failed, {stats.recovered} recovered, {stats.bounced} bounced"
            )
