"""`manage.py leases_worker`: run queued jobs, as many at once as `--concurrency`.

SIGTERM or SIGINT stops claiming and lets running jobs finish within `--grace` seconds,
then hands the rest back to the queue; a second signal exits at once (the jobs it ran
are recovered by other workers when its heartbeat lapses). Exit 2 on bad arguments.
"""
from __future__ import annotations

import math
import signal
from importlib import import_module
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leases.tasks import queue as jobqueue
from leases.tasks import registry
from leases.tasks.worker import Worker


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError
    return value


def known_queues(using: str | None = None) -> set[str]:
    """Queues a worker may name: those with a row, a handler's, or a Tasks backend's."""
    names = set(jobqueue.all_queues(using)) | {spec.queue for spec in registry.registered().values()}
    try:
        from leases.tasks.backend import configured_queues
    except ImportError:  # no Tasks framework installed: native jobs only
        return names
    return names | configured_queues()


class Command(BaseCommand):
    help = "Run jobs of the delayed queue (and Django Tasks of the leases backend)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", default="default", help="queues to serve, comma-separated, or * (default: default)")
        parser.add_argument("--concurrency", type=int, default=4, help="jobs run at once, in threads (default 4)")
        parser.add_argument("--poll", type=_positive, default=0.05, help="seconds between polls while idle (default 0.05)")
        parser.add_argument("--ttl", type=_positive, default=30.0, help="heartbeat lease in seconds (default 30)")
        parser.add_argument("--grace", type=float, default=25.0, help="seconds running jobs get to finish on SIGTERM")
        parser.add_argument("--burst", action="store_true", help="exit when nothing is ready")
        parser.add_argument("--max-jobs", type=int, default=None, help="exit after claiming this many jobs")
        parser.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers (repeatable)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for module in options["imports"]:
            try:
                import_module(module)
            except ImportError as exc:
                raise CommandError(f"--import {module}: {exc}", returncode=2) from None
        if options["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1", returncode=2)
        if options["max_jobs"] is not None and options["max_jobs"] < 1:
            raise CommandError("--max-jobs must be at least 1", returncode=2)
        if not 0 <= options["grace"] < math.inf:
            raise CommandError("--grace must be seconds >= 0", returncode=2)
        names = [name.strip() for name in options["queue"].split(",") if name.strip()]
        if not names:
            raise CommandError("--queue names no queue", returncode=2)
        if names != ["*"]:
            unknown = sorted(set(names) - known_queues())
            if "*" in names or unknown:
                raise CommandError(
                    f"unknown queue(s): {', '.join(unknown or ['*'])} (known: {', '.join(sorted(known_queues())) or 'none'})",
                    returncode=2,
                )
        worker = Worker(
            queues=names,
            concurrency=options["concurrency"],
            poll=options["poll"],
            ttl=options["ttl"],
            burst=options["burst"],
            max_jobs=options["max_jobs"],
            grace=options["grace"],
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
        worker.register()
        if options["verbosity"] > 0:
            self.stderr.write(f"worker {worker.name}: queues {','.join(names)}, concurrency {worker.concurrency}")
        stats = worker.run()
        if options["verbosity"] > 0:
            self.stderr.write(
                f"worker {worker.name}: {stats.claimed} claimed, {stats.succeeded} succeeded, "
                f"{stats.failed} failed, {stats.recovered} recovered"
            )
