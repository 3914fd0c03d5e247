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
from leases.management.base import EX_TEMPFAIL, LeasesCommand
from leases.management.lines import bad_line, entries
from leases.progress import Progress
from leases.tasks import Dispatcher
from leases.tasks.models import TaskPool


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


class Command(LeasesCommand):
    help = "Load, hand out and inspect the task pool of a dispatcher."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        load = sub.add_parser("load", help="replace the pool with the tasks of FILE (lines value,score)")
        load.add_argument("name")
        load.add_argument("file")
        assign = sub.add_parser("assign", help="print WORKER's bucket, topped up to LIMIT, as JSON")
        assign.add_argument("name")
        assign.add_argument("worker")
        assign.add_argument("limit", type=int)
        done = sub.add_parser("done", help="take TASKs (all when none given) out of WORKER's bucket")
        done.add_argument("name")
        done.add_argument("worker")
        done.add_argument("tasks", nargs="*")
        check = sub.add_parser("check", help="exit 0 if WORKER's bucket holds exactly TASKs, else 1")
        check.add_argument("name")
        check.add_argument("worker")
        check.add_argument("tasks", nargs="*")
        stats = sub.add_parser("stats", help="pool size and buckets, as JSON")
        stats.add_argument("name")
        reclaim = sub.add_parser("reclaim", help="return buckets of workers not seen for a while")
        reclaim.add_argument("name")
        reclaim.add_argument("--stale-after", default="10m", help="e.g. 90s, 10m, 2h (default 10m)")

    def handle(self, *args: Any, action: str, name: str, **options: Any) -> None:
        try:
            dispatcher = Dispatcher(name)
            if action != "load" and not TaskPool.objects.filter(name=name).exists():
                raise CommandError(f"unknown dispatcher {name!r} (load its pool first)", returncode=2)
            getattr(self, f"_{action}")(dispatcher, **options)
        except Locked as exc:
            raise CommandError(f"{exc} (another rebuild is running)", returncode=EX_TEMPFAIL) from None

    def _load(self, dispatcher: Dispatcher, file: str, **options: Any) -> None:
        tasks = read_tasks(file)
        with Progress(len(tasks), f"loading {dispatcher.name}", stream=self.stderr) as bar:
            listed = dispatcher.recreate_task_pool(tasks, progress=bar.advance)
        self.stdout.write(f"{listed} tasks in the pool of {dispatcher.name}")

    def _assign(self, dispatcher: Dispatcher, worker: str, limit: int, **options: Any) -> None:
        self.stdout.write(json.dumps(dispatcher.assign_tasks(limit, worker)))

    def _done(self, dispatcher: Dispatcher, worker: str, tasks: list[str], **options: Any) -> None:
        self.stdout.write(str(dispatcher.tasks_done(worker, tasks or None)))

    def _check(self, dispatcher: Dispatcher, worker: str, tasks: list[str], **options: Any) -> None:
        if not dispatcher.check_tasks(worker, tasks):
            raise CommandError(f"the bucket of {worker} holds other tasks", returncode=1)
        self.stdout.write("ok")

    def _stats(self, dispatcher: Dispatcher, **options: Any) -> None:
        self.stdout.write(json.dumps(dispatcher.stats(), indent=2))

    def _reclaim(self, dispatcher: Dispatcher, stale_after: str, **options: Any) -> None:
        returned = dispatcher.reclaim(parse_duration(stale_after))
        self.stdout.write(f"{returned} tasks back in the pool")
