"""`manage.py pipeline`: start, list, inspect, steer, wait for and prune pipeline runs.

Exit codes: 0 done; 1 `wait` saw the run fail or be cancelled; 2 bad input (nothing
written); 75 (EX_TEMPFAIL) `wait` timed out, or the database is unavailable.
"""
from __future__ import annotations

import math
import re
import time
from datetime import datetime
from typing import Any

from django.core.management.base import CommandError, CommandParser

from leases import db, routing
from leases.clock import db_now
from leases.durations import parse_duration
from leases.exceptions import UnknownHandler
from leases.management.base import EX_TEMPFAIL, EX_USAGE, LeasesCommand, add_database_option, import_modules
from leases.management.text import (
    MAX_LIMIT,
    block,
    clock,
    elapsed,
    limit_of,
    parse_json,
    shown,
    span,
    table,
)
from leases.pipelines import definition
from leases.pipelines.models import Run, StageRun
from leases.pipelines.report import STATUS_ORDER, RunReport, failed_tasks, progress
from leases.pipelines.runs import prune

#: Seconds between two looks at the run in `wait`.
POLL = 0.5
#: Columns of the timeline's time axis.
TIMELINE_WIDTH = 60
#: Characters of an error shown in a table cell (the run's own error is shown whole).
ERROR_WIDTH = 100
#: Largest id a database key column holds; a bigger number names no run.
MAX_ID = 2**63 - 1
_ID = re.compile(r"[0-9]+")


def run_id(text: str) -> int:
    """A run id as typed; ValueError (exit 2) for anything but a whole number that a key
    column can hold, in the words `jobs` uses for a job id."""
    if not _ID.fullmatch(text) or not 0 < int(text) <= MAX_ID:
        raise ValueError(f"a run id is a whole number from 1 to {MAX_ID}, not {text!r}")
    return int(text)


def find_run(text: str, using: str) -> Run:
    """The run named on the command line; ValueError (exit 2) when there is none."""
    number = run_id(text)
    found = Run.objects.using(using).filter(pk=number).first()
    if found is None:
        raise ValueError(f"no pipeline run #{number}")
    return found


def cell(text: str) -> str:
    """An error for a table cell: printable, on one line, cut to ERROR_WIDTH."""
    text = shown(text)
    return text if len(text) <= ERROR_WIDTH else text[: ERROR_WIDTH - 3] + "..."


def bar(start: datetime | None, end: datetime | None, origin: datetime, seconds: float) -> str:
    """`#` from start to end on an axis of TIMELINE_WIDTH columns over `seconds` from
    `origin`; at least one column for anything that started, none for what did not."""
    if start is None or end is None:
        return " " * TIMELINE_WIDTH
    scale = TIMELINE_WIDTH / seconds

    def column(moment: datetime) -> float:
        return (moment - origin).total_seconds() * scale

    first = min(max(int(column(start)), 0), TIMELINE_WIDTH - 1)
    last = min(max(math.ceil(column(end)), first + 1), TIMELINE_WIDTH)
    return " " * first + "#" * (last - first) + " " * (TIMELINE_WIDTH - last)


class Command(LeasesCommand):
    help = (
        "Start, list, inspect, steer and wait for pipeline runs. Exit codes: 0 done, 1 wait saw "
        "the run fail or be cancelled, 2 bad input (nothing written), 75 wait timed out or the "
        "database is unavailable."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        start = sub.add_parser("start", help="start a run of pipeline NAME and print its id")
        start.add_argument("name", help="the pipeline's registered name")
        start.add_argument("--context", help="the run's context, as JSON (default {})")
        start.add_argument("--key", help="one live run per key: print the live run's id if there is one")
        start.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers and pipelines (repeatable)",
        )
        listing = sub.add_parser("list", help="runs, newest first")
        listing.add_argument("--status", help=f"only runs in this status ({', '.join(s for s, _ in Run.STATUSES)})")
        listing.add_argument("--name", help="only runs of this pipeline")
        listing.add_argument("--limit", default="50", help=f"runs shown (default 50, at most {MAX_LIMIT})")
        show = sub.add_parser("show", help="a run with its stages, tasks and a timeline")
        show.add_argument("run", help="the run's id")
        for action, text in [
            ("cancel", "stop a live run: nothing new starts, waiting tasks are cancelled"),
            ("pause", "start nothing new until resume; running tasks finish"),
            ("resume", "let a paused run go on (and record tasks whose job ended unheeded)"),
        ]:
            one = sub.add_parser(action, help=text)
            one.add_argument("run", help="the run's id")
        restart = sub.add_parser("restart", help="run a failed or cancelled stage again, then what depends on it")
        restart.add_argument("run", help="the run's id")
        restart.add_argument("stage", help="the stage's name")
        wait = sub.add_parser("wait", help="wait for the run to end: exit 0 succeeded, 1 failed or cancelled")
        wait.add_argument("run", help="the run's id")
        wait.add_argument("--timeout", help="give up (exit 75) after e.g. 30, 30s, 10m (default: never)")
        prune = sub.add_parser("prune", help="delete runs that ended long ago, with their stages and tasks")
        prune.add_argument("--older-than", required=True, help="e.g. 12h, 30d (ended before now minus this)")
        add_database_option(*sub.choices.values())

    def handle(self, *args: Any, action: str, database: str | None, **options: Any) -> None:
        self.using = routing.known(database or db.alias())
        getattr(self, f"_{action}")(**options)

    def _start(self, name: str, context: str | None, key: str | None, imports: list[str], **options: Any) -> None:
        import_modules(imports)
        data = None if context is None else parse_json(context, "--context")
        pipeline = definition.get(name)
        try:
            run = pipeline.start(context=data, key=key, using=self.using)
        except UnknownHandler as exc:
            raise CommandError(f"pipeline {name!r}: {exc}", returncode=EX_USAGE) from None
        if not run.created:
            self.stderr.write(f"run #{run.pk} of key {shown(run.key)} is already live")
        self.stdout.write(str(run.pk))

    def _list(self, status: str | None, name: str | None, limit: str, **options: Any) -> None:
        statuses = [s for s, _ in Run.STATUSES]
        if status is not None and status not in statuses:
            raise ValueError(f"--status must be one of {', '.join(statuses)}, not {status!r}")
        count = limit_of(limit)
        runs = Run.objects.using(self.using).defer("definition", "context").with_progress().order_by("-pk")
        if status is not None:
            runs = runs.filter(status=status)
        if name is not None:
            runs = runs.filter(pipeline=name)
        now = db_now(self.using)
        found = list(runs[:count])
        failed = failed_tasks([run.pk for run in found], self.using)
        lines = [["ID", "PIPELINE", "KEY", "STATUS", "PROGRESS", "STARTED", "DURATION"]]
        for run in found:
            lines.append([
                str(run.pk), shown(run.pipeline), shown(run.key), run.status,
                progress(run.tasks_done, run.tasks_total, failed.get(run.pk, 0)),
                clock(run.queued_at), elapsed(run.queued_at, run.finished_at, now if run.status in Run.LIVE else None),
            ])
        self.stdout.write(table(lines) if found else "no runs")

    def _show(self, run: str, **options: Any) -> None:
        Show(find_run(run, self.using), self.using).write(self.stdout.write)

    def _cancel(self, run: str, **options: Any) -> None:
        found = find_run(run, self.using)
        done = found.cancel()
        self.stdout.write(f"run #{found.pk} {'cancelled' if done else 'had already ended'}")

    def _pause(self, run: str, **options: Any) -> None:
        found = find_run(run, self.using)
        done = found.pause()
        self.stdout.write(f"run #{found.pk} {'paused' if done else 'was already paused'}")

    def _resume(self, run: str, **options: Any) -> None:
        found = find_run(run, self.using)
        done = found.resume()
        self.stdout.write(f"run #{found.pk} {'resumed' if done else 'was not paused; its queued tasks were checked'}")

    def _restart(self, run: str, stage: str, **options: Any) -> None:
        found = find_run(run, self.using)
        found.restart(stage)
        self.stdout.write(f"run #{found.pk}: stage {shown(stage)} restarted; the run is {found.status}")

    def _wait(self, run: str, timeout: str | None, **options: Any) -> None:
        try:
            limit = None if timeout is None else parse_duration(timeout)
        except ValueError as exc:
            raise ValueError(f"--timeout: {exc}") from None
        found = find_run(run, self.using)
        deadline = None if limit is None else time.monotonic() + limit
        rows = Run.objects.using(self.using).filter(pk=found.pk).values_list("status", "error")
        while True:
            row = rows.first()
            if row is None:
                raise CommandError(f"run #{found.pk} was deleted", returncode=1)
            status, error = row
            if status not in Run.LIVE:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CommandError(f"run #{found.pk} is still {status} after {limit:g}s", returncode=EX_TEMPFAIL)
            time.sleep(POLL if left is None else min(POLL, left))
        if status != Run.SUCCEEDED:
            detail = f": {shown(error)}" if error and error != status else ""
            raise CommandError(f"run #{found.pk} {status}{detail}", returncode=1)
        self.stdout.write(f"run #{found.pk} succeeded")

    def _prune(self, older_than: str, verbosity: int, **options: Any) -> None:
        try:
            seconds = parse_duration(older_than, unit=True)  # as leases_prune: a bare 7 is no 7 days
        except ValueError as exc:
            raise ValueError(f"--older-than: {exc}") from None
        total = 0

        def progress(count: int) -> None:
            nonlocal total
            total += count
            if verbosity > 1:
                self.stderr.write(f"deleted {total} runs so far")

        deleted = prune(seconds, using=self.using, progress=progress)
        if verbosity > 0:
            self.stdout.write(f"deleted {deleted} pipeline run(s) that ended more than {older_than} ago")


class Show:
    """What `pipeline show` prints of one run (see leases.pipelines.report)."""

    def __init__(self, run: Run, using: str) -> None:
        self.report = RunReport(run, using)

    def write(self, out: Any) -> None:
        report, run = self.report, self.report.run
        head = [
            ["run", f"#{run.pk}"],
            ["pipeline", shown(run.pipeline)],
            ["key", shown(run.key)],
            ["status", run.status],
            ["error", shown(run.error)],
            ["progress", progress(report.tasks_done, report.tasks_total, report.failed(), " tasks done")],
            ["queued", clock(run.queued_at)],
            ["started", clock(run.started_at)],
            ["finished", clock(run.finished_at)],
            ["duration", elapsed(run.queued_at, run.finished_at, report.now if report.live else None)],
        ]
        out(table([line for line in head if line[1]]))
        out(block("context", run.context))
        out("")
        out(self._stage_table())
        for stage in report.stages:
            if report.picked[stage.pk]:
                out("")
                out(f"stage {shown(stage.name)}: {report.total(stage):,} task(s)")
                out(self._task_table(stage))
        if any(report.picked.values()):
            out("")
            out(self._timeline())

    def _stage_table(self) -> str:
        report = self.report
        lines = [["STAGE", "STATUS", "TASKS", "STARTED", "FINISHED", "DURATION", "ERROR"]]
        for stage in report.stages:
            start, end, going = report.stage_times(stage)
            tasks = progress(report.done(stage), report.total(stage), report.failed(stage))
            lines.append([
                shown(stage.name), stage.status, tasks, clock(start), clock(end), elapsed(start, end, going),
                cell(stage.error),
            ])
        return table(lines)

    def _task_table(self, stage: StageRun) -> str:
        report = self.report
        lines = [["  TASK", "ITEM", "STATUS", "ATTEMPTS", "DURATION", "ERROR"]]
        for task in report.picked[stage.pk]:
            start, end = report.times(task)
            lines.append([
                f"  {shown(task.task)}", "" if task.item_index is None else str(task.item_index), report.status(task),
                str(task.attempts), elapsed(start, end, None), cell(task.error),
            ])
        text = table(lines)
        rest = report.left_out(stage)
        if rest:
            parts = [f"{rest[status]:,} {status}" for status in STATUS_ORDER if rest[status] > 0]
            text += f"\n  ... and {sum(rest.values()):,} more: {', '.join(parts)}"
        return text

    def _timeline(self) -> str:
        found = self.report.timeline()
        if found is None:
            return "timeline: no task has started yet"
        legend = f"timeline: {TIMELINE_WIDTH} columns = {span(found.seconds)} from {clock(found.origin)}"
        if found.not_started:
            legend += f"; {found.not_started} task(s) listed above have not started"
        lines = [
            [shown(b.stage.name), shown(str(b.task)), f"|{bar(b.start, b.end, found.origin, found.seconds)}|"]
            for b in found.bars
        ]
        return legend + "\n" + table(lines)
