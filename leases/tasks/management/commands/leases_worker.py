"""`manage.py leases_worker`: run queued jobs, as many at once as `--concurrency`.

SIGTERM or SIGINT stops claiming and lets running jobs finish within `--grace` seconds,
then hands the rest back to the queue; a second signal exits at once (the jobs it ran
are recovered by other workers when its heartbeat lapses). A database outage is waited
out, at start as in the middle of work. Exit 2 on bad arguments.

Queues routed to several databases (LEASES_ROUTES) are served by one worker per database,
side by side in this process, each with `--concurrency` threads.

Every worker but a `--burst` one (which leaves once its queues are empty) or one with
`--no-schedule` takes part in leading the scheduler, whatever queues it serves: a tick
only writes its job, on the queue that serves it (leases.tasks.schedules.serving).
"""
from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import Error, connections

from leases import db, logs, routing
from leases.management.base import EX_USAGE, LeasesCommand, import_modules
from leases.tasks import schedules
from leases.tasks.jobs.queues import known_queues
from leases.tasks.worker import MIN_TTL, JobWorker
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
    help = ("Run jobs of the delayed queue (and Django Tasks of the leases backend). Exit codes: 0 stopped, or "
            "out of work with --burst; 1 a second SIGTERM or SIGINT stopped it at once; 2 bad input.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", default="default", help="queues to serve, comma-separated, or * (default: default)")
        parser.add_argument("--database", help="the database alias to serve them on (default: where LEASES_ROUTES "
                                               "sends each queue; * serves every database in use)")
        parser.add_argument("--concurrency", type=int, default=4,
                            help="jobs run at once, in threads or on the event loop of async handlers (default 4)")
        parser.add_argument("--poll", default="0.05", help="seconds between polls while idle (default 0.05; "
                            "on PostgreSQL pushes wake the worker at once and it polls every second)")
        parser.add_argument("--ttl", default="30", help=f"heartbeat lease in seconds, at least {MIN_TTL:g} (default 30)")
        parser.add_argument("--grace", default="25", help="seconds running jobs get to finish on SIGTERM, and a"
                            " cancelled running job to stop before it is abandoned (default 25)")
        parser.add_argument("--burst", action="store_true",
                            help="exit when nothing is ready (after retries and durable sleeps due within a minute)")
        parser.add_argument("--max-jobs", type=int, default=None, help="exit after claiming this many jobs")
        parser.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers (repeatable)",
        )
        parser.add_argument(
            "--log-format", choices=("plain", "json"), default="plain",
            help="plain: timestamped lines (default); json: one JSON object a line, for log shippers",
        )
        parser.add_argument(
            "--no-listen", action="store_true",
            help="on PostgreSQL, poll only: do not LISTEN for pushes (which wake the worker at once)",
        )
        parser.add_argument(
            "--no-schedule", action="store_true",
            help="take no part in firing schedules (by default one worker at a time, not a --burst one, leads and"
                 " fires them) and leave LEASES_SCHEDULES unapplied",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        logs.configure(options["log_format"], options["verbosity"])
        poll = _seconds(options["poll"], "--poll", maximum=MAX_POLL)
        ttl = _seconds(options["ttl"], "--ttl", minimum=MIN_TTL, above=False)
        grace = _seconds(options["grace"], "--grace", above=False)
        import_modules(options["imports"])
        if not 1 <= options["concurrency"] <= MAX_CONCURRENCY:
            raise CommandError(f"--concurrency must be at least 1 and at most {MAX_CONCURRENCY}", returncode=EX_USAGE)
        if options["max_jobs"] is not None and options["max_jobs"] < 1:
            raise CommandError("--max-jobs must be at least 1", returncode=EX_USAGE)
        names = [name.strip() for name in options["queue"].split(",") if name.strip()]
        if not names:
            raise CommandError("--queue names no queue", returncode=EX_USAGE)
        workers = [
            JobWorker(
                queues=queues,
                concurrency=options["concurrency"],
                poll=poll,
                ttl=ttl,
                burst=options["burst"],
                max_jobs=options["max_jobs"],
                grace=grace,
                using=alias,
                # Schedules live on LEASES_DATABASE: its worker takes part in firing them,
                # unless it leaves as soon as its queues are empty.
                schedule=not options["no_schedule"] and not options["burst"] and alias == db.alias(),
                listen=not options["no_listen"],
            )
            for alias, queues in by_database(names, options["database"]).items()
        ]
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: [worker.stop() for worker in workers])
        for worker in workers:
            if not self._ready(worker, apply=not options["no_schedule"] and worker.using == db.alias()):
                return  # stopped while waiting for the database
        others = [threading.Thread(target=worker.run, name=f"worker on {worker.using}") for worker in workers[1:]]
        for thread in others:
            thread.start()
        workers[0].run()  # each worker's last log line sums up what it did
        for thread in others:
            thread.join()

    @staticmethod
    def _ready(worker: JobWorker, apply: bool) -> bool:
        """Check what a worker serves before it starts: its database answers (an outage
        is waited out; anything else, such as a wrong password, is bad input), its queues
        are known, the schedules of LEASES_SCHEDULES apply (`apply`: a --burst worker
        applies them too, though it does not lead). False if stopped meanwhile."""
        try:  # an outage is waited out, said at once (the reads below retry for seconds first)
            if worker.when_up(connections[worker.using].ensure_connection) is None and worker.stopping:
                return False
        except Error as exc:
            queues = ", ".join(worker.queues)
            raise CommandError(f"database {worker.using!r} (queues {queues}): {exc}".splitlines()[0],
                               returncode=EX_USAGE) from None
        if worker.queues != ["*"]:
            known = worker.when_up(lambda: known_queues(worker.using))
            if known is None:
                return False
            unknown = sorted(set(worker.queues) - known)
            if "*" in worker.queues or unknown:
                raise CommandError(
                    f"unknown queue(s): {', '.join(unknown or ['*'])} (known: {', '.join(sorted(known)) or 'none'})",
                    returncode=EX_USAGE,
                )
        if apply:
            try:
                applied = worker.when_up(schedules.apply_settings)
            except (ValueError, LookupError) as exc:  # LookupError: UnknownHandler
                raise CommandError(str(exc).splitlines()[0], returncode=EX_USAGE) from None
            if applied is None:
                return False
        return True


def by_database(names: list[str], database: str | None) -> dict[str, list[str]]:
    """The queues each worker serves, by database alias: all on `database` when given
    (`*`: every database in use), else each where LEASES_ROUTES sends it."""
    if database == "*":
        return {alias: names for alias in routing.aliases()}
    if database or names == ["*"]:
        return {routing.known(database) if database else db.alias(): names}
    found: dict[str, list[str]] = {}
    for name in names:
        found.setdefault(routing.route("queues", name), []).append(name)
    return found
