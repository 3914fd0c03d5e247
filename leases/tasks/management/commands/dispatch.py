"""`manage.py dispatch`: load, hand out and inspect the task pool of a dispatcher.

Exit codes: 0 done, 1 `check` found a different bucket, 2 bad input (nothing written),
75 another rebuild of the same dispatcher is running, or the database is unavailable.
"""
from __future__ import annotations

import json
import math
from typing import Any

from django.core.management.base import CommandError, CommandParser

from leases import Locked
from leases.durations import parse_duration
from leases.management.base import EX_TEMPFAIL, EX_USAGE, LeasesCommand, add_database_option
from leases.management.lines import bad_line, entries
from leases.progress import progress_bar
from leases.tasks import Dispatcher
from leases.tasks.models import DispatchWorker, TaskPool


def read_tasks(path: str) -> dict[str, float]:
    """Parse `value,score` lines (the score after the last comma); say which line is wrong."""
    tasks: dict[str, float] = {}
    for number, line in entries(path):
        value, comma, score = line.rpartition(",")
        if not comma or not value.strip():
            raise bad_line(path, number, line, "expected value,score")
        try:
            tasks[value.strip()] = float(score)
        except ValueError:
            raise bad_line(path, number, line, f"score {score.strip()!r} is not a number") from None
        if not math.isfinite(tasks[value.strip()]):
            raise bad_line(path, number, line, f"score {score.strip()!r} is not a finite number")
    return tasks


NAME_HELP = "the dispatcher's name (it exists once its pool was loaded)"
WORKER_HELP = "a worker that was assigned tasks"
#: Worker names an unknown-worker error lists.
KNOWN_SHOWN = 20


class Command(LeasesCommand):
    help = ("Load, hand out and inspect the task pool of a dispatcher. Exit codes: 0 done, 1 check found a "
            "different bucket, 2 bad input (nothing written), 75 another rebuild is running or the database "
            "is unavailable.")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        load = sub.add_parser("load", help="replace the pool with the tasks of FILE (lines value,score)")
        load.add_argument("name", help=NAME_HELP)
        load.add_argument("file", help="lines `value,score` (the score after the last comma); # starts a comment")
        assign = sub.add_parser("assign", help="print WORKER's bucket, topped up to LIMIT, as JSON")
        assign.add_argument("name", help=NAME_HELP)
        assign.add_argument("worker", help="the worker's name, as it will report tasks done")
        assign.add_argument("limit", type=int, help="the most tasks its bucket holds")
        done = sub.add_parser("done", help="take TASKs (all when none given) out of WORKER's bucket")
        done.add_argument("name", help=NAME_HELP)
        done.add_argument("worker", help=WORKER_HELP)
        done.add_argument("tasks", nargs="*", help="task values (default: the whole bucket)")
        check = sub.add_parser("check", help="exit 0 if WORKER's bucket holds exactly TASKs, else 1")
        check.add_argument("name", help=NAME_HELP)
        check.add_argument("worker", help=WORKER_HELP)
        check.add_argument("tasks", nargs="*", help="the task values it should hold")
        stats = sub.add_parser("stats", help="pool size and buckets, as JSON")
        stats.add_argument("name", help=NAME_HELP)
        reclaim = sub.add_parser("reclaim", help="return buckets of workers not seen for a while")
        reclaim.add_argument("name", help=NAME_HELP)
        reclaim.add_argument("--stale-after", default="10m", help="e.g. 90s, 10m, 2h (default 10m)")
        add_database_option(*sub.choices.values())

    def handle(self, *args: Any, action: str, name: str, database: str | None, **options: Any) -> None:
        try:
            dispatcher = Dispatcher(name, using=database)
            if action != "load" and not TaskPool.objects.using(dispatcher.using).filter(name=name).exists():
                raise CommandError(f"unknown dispatcher {name!r} (load its pool first)", returncode=2)
            getattr(self, f"_{action}")(dispatcher, **options)
        except Locked as exc:
            raise CommandError(f"{exc} (another rebuild is running)", returncode=EX_TEMPFAIL) from None

    def _load(self, dispatcher: Dispatcher, file: str, **options: Any) -> None:
        tasks = read_tasks(file)
        with progress_bar(len(tasks), f"loading {dispatcher.name}", self.stderr) as bar:
            listed = dispatcher.recreate_task_pool(tasks, progress=bar.update)
        self.stdout.write(f"{listed} tasks in the pool of {dispatcher.name}")

    def _assign(self, dispatcher: Dispatcher, worker: str, limit: int, **options: Any) -> None:
        self.stdout.write(json.dumps(dispatcher.assign_tasks(limit, worker)))

    @staticmethod
    def _known(dispatcher: Dispatcher, worker: str) -> None:
        """A worker with no entry was never assigned tasks (a typo, usually) or was reclaimed
        (its tasks went back to the pool): either way nothing it reports counts, so say so."""
        rows = DispatchWorker.objects.using(dispatcher.using).filter(dispatcher=dispatcher.name)
        if rows.filter(name=worker).exists():
            return
        known = list(rows.order_by("name").values_list("name", flat=True)[: KNOWN_SHOWN + 1])
        listed = ", ".join(known[:KNOWN_SHOWN]) + (", ..." if len(known) > KNOWN_SHOWN else "")
        raise CommandError(f"no worker {worker!r} in dispatcher {dispatcher.name!r}: never assigned tasks, "
                           f"or reclaimed (known workers: {listed or 'none'})", returncode=EX_USAGE)

    def _done(self, dispatcher: Dispatcher, worker: str, tasks: list[str], **options: Any) -> None:
        self._known(dispatcher, worker)
        self.stdout.write(str(dispatcher.tasks_done(worker, tasks or None)))

    def _check(self, dispatcher: Dispatcher, worker: str, tasks: list[str], **options: Any) -> None:
        self._known(dispatcher, worker)
        if not dispatcher.check_tasks(worker, tasks):
            raise CommandError(f"the bucket of {worker} holds other tasks", returncode=1)
        self.stdout.write("ok")

    def _stats(self, dispatcher: Dispatcher, **options: Any) -> None:
        self.stdout.write(json.dumps(dispatcher.stats(), indent=2))

    def _reclaim(self, dispatcher: Dispatcher, stale_after: str, **options: Any) -> None:
        try:
            seconds = parse_duration(stale_after)
        except ValueError as exc:
            raise ValueError(f"--stale-after: {exc}") from None
        returned = dispatcher.reclaim(seconds)
        self.stdout.write(f"{returned} tasks back in the pool")
