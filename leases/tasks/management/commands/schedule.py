"""`manage.py schedule`: list, add, fire, enable, disable, remove and show schedules.

Exit codes: 0 done; 2 bad input (nothing written); 75 the database is unavailable.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import CommandParser

from leases import db, routing
from leases.clock import db_now
from leases.durations import parse_duration
from leases.management.base import LeasesCommand, add_database_option, import_modules
from leases.management.text import block, clock, elapsed, parse_json, shown, table, when
from leases.tasks import schedules
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules.serving import place, serving

#: Fire times `show` lists.
UPCOMING = 5
#: Characters of an error in a table cell.
ERROR_WIDTH = 80


def what(row: Schedule) -> str:
    return shown(row.handler) if row.handler else f"pipeline {shown(row.pipeline)}"


def parse_at(text: str) -> datetime:
    """An ISO 8601 time with its offset, e.g. 2027-01-01T00:00:00+00:00 (or ...Z)."""
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00") if text.strip().endswith("Z") else text)
    except ValueError:
        raise ValueError(f"--at must be an ISO 8601 time such as 2027-01-01T09:00:00+01:00, not {text!r}") from None
    if value.tzinfo is None:
        raise ValueError(f"--at {text!r} has no time zone: add one, e.g. {text}+00:00 or {text}Z")
    return value


class Command(LeasesCommand):
    help = "List, add, fire now, enable, disable, remove and show schedules. Exit codes: 0 done, 2 bad input " \
           "(nothing written), 75 database unavailable."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="every schedule: what, when, next fire by the database clock, last status")
        add = sub.add_parser("add", help="make a schedule (or update the one of that name)")
        add.add_argument("name", help="the schedule's name")
        add.add_argument("handler", nargs="?", help="the handler its ticks push a job to (or --pipeline)")
        add.add_argument("--pipeline", help="start a run of this pipeline on each tick instead")
        timing = add.add_mutually_exclusive_group()
        timing.add_argument("--cron", help="a cron expression, e.g. '0 3 * * *' (in --timezone)")
        timing.add_argument("--every", help="an interval, e.g. 30s, 5m, 1h")
        timing.add_argument("--at", help="once, at an ISO 8601 time with its offset, e.g. 2027-01-01T09:00:00+01:00")
        add.add_argument("--timezone", help="time zone of --cron (default: settings.TIME_ZONE)")
        add.add_argument("--payload", help="the job's payload, as JSON (a handler's schedule)")
        add.add_argument("--context", help="the run's context, as JSON (a pipeline's schedule)")
        add.add_argument("--queue", help="queue of the jobs (default: the handler's)")
        add.add_argument("--priority", default="0", help="priority of the jobs (default 0)")
        add.add_argument("--catch-up", default="last", help="after a stop: last (default), none or all")
        add.add_argument("--disabled", action="store_true", help="make it disabled")
        add.add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers and pipelines (repeatable)",
        )
        for action, text in [
            ("run", "fire a run now, outside the tick sequence"),
            ("enable", "enable it; its next tick counts from now"),
            ("disable", "fire nothing until enabled again"),
            ("remove", "delete it and its history"),
            ("show", f"its definition, the queue of its jobs and who serves it, next {UPCOMING} fire times and"
                     " last runs"),
        ]:
            one = sub.add_parser(action, help=text)
            one.add_argument("name", help="the schedule's name")
        sub.choices["show"].add_argument(
            "--import", dest="imports", action="append", default=[], metavar="MODULE",
            help="import MODULE for its handlers and pipelines (repeatable), to tell the queue of its jobs",
        )
        add_database_option(*sub.choices.values())

    def handle(self, *args: Any, action: str, database: str | None, **options: Any) -> None:
        self.using = routing.known(database or db.alias())
        getattr(self, f"_{action}")(**options)

    def _row(self, name: str) -> Schedule:
        row = Schedule.objects.using(self.using).filter(name=name).first()
        if row is None:
            known = ", ".join(Schedule.objects.using(self.using).values_list("name", flat=True)[:10]) or "none"
            raise ValueError(f"no schedule named {name!r} (known: {known})")
        return row

    def _list(self, **options: Any) -> None:
        using = self.using
        now = db_now(using)
        rows = list(Schedule.objects.using(using).order_by("name"))
        last = {}
        for row in rows:  # a schedule's newest run, through its (schedule, number) index
            last[row.pk] = ScheduleRun.objects.using(using).filter(schedule=row).order_by("-number").first()
        jobs = dict(Job.objects.using(using).filter(pk__in=[r.job_id for r in last.values() if r and r.job_id])
                    .values_list("pk", "status"))
        lines = [["NAME", "WHAT", "WHEN", "NEXT", "LAST", "STATUS", "ENABLED", "SOURCE"]]
        for row in rows:
            run = last[row.pk]
            lines.append([
                shown(row.name), what(row), shown(schedules.Timing.of(row).describe()),
                when(row.next_fire_at, now) if row.enabled else "-", clock(row.last_fire_at) or "-",
                schedules.status_of(run, jobs.get(run.job_id)) if run else "-", "yes" if row.enabled else "no",
                row.source,
            ])
        self.stdout.write(table(lines) if rows else "no schedules")

    def _add(self, name: str, handler: str | None, pipeline: str | None, cron: str | None, every: str | None,
             at: str | None, timezone: str | None, payload: str | None, context: str | None, queue: str | None,
             priority: str, catch_up: str, disabled: bool, imports: list[str], **options: Any) -> None:
        import_modules(imports)
        try:
            number = int(priority)
        except ValueError:
            raise ValueError(f"--priority must be a whole number, not {priority!r}") from None
        try:
            seconds = None if every is None else parse_duration(every)
        except ValueError as exc:
            raise ValueError(f"--every: {exc}") from None
        try:
            row = schedules.schedule(
                name, handler, pipeline=pipeline, cron=cron, every=seconds,
                at=None if at is None else parse_at(at), timezone=timezone,
                payload=None if payload is None else parse_json(payload, "--payload"),
                context=None if context is None else parse_json(context, "--context"),
                queue=queue, priority=number, enabled=not disabled, catch_up=catch_up, using=self.using,
            )
        except LookupError as exc:  # UnknownHandler
            raise ValueError(str(exc)) from None
        next_fire = when(row.next_fire_at, db_now(self.using)) if row.enabled else "- (disabled)"
        self.stdout.write(
            f"schedule {shown(row.name)}: {what(row)}, {shown(schedules.Timing.of(row).describe())}; next fire "
            f"{next_fire}"
        )

    def _run(self, name: str, **options: Any) -> None:
        run = schedules.fire_now(self._row(name).name, using=self.using)
        self.stdout.write(f"schedule {shown(name)}: run #{run.number} fired, job #{run.job_id}")

    def _enable(self, name: str, **options: Any) -> None:
        changed = schedules.set_enabled(self._row(name).name, True, using=self.using)
        self.stdout.write(f"schedule {shown(name)} {'enabled' if changed else 'was enabled already'}")

    def _disable(self, name: str, **options: Any) -> None:
        changed = schedules.set_enabled(self._row(name).name, False, using=self.using)
        self.stdout.write(f"schedule {shown(name)} {'disabled' if changed else 'was disabled already'}")

    def _remove(self, name: str, **options: Any) -> None:
        row = self._row(name)
        if row.source == Schedule.SETTINGS:
            raise ValueError(f"schedule {name!r} comes from settings.LEASES_SCHEDULES: remove it there")
        schedules.unschedule(row.name, using=self.using)
        self.stdout.write(f"schedule {shown(name)} removed")

    def _show(self, name: str, imports: list[str], **options: Any) -> None:
        import_modules(imports)
        using = self.using
        row = self._row(name)
        now = db_now(using)
        timing = schedules.Timing.of(row)
        head = [
            ["name", shown(row.name)], ["what", what(row)], ["when", shown(timing.describe())],
            ["cron", shown(row.cron)],
            ["at", clock(row.at)], ["timezone", row.timezone if row.cron else ""],
            *self._queue(row), ["priority", str(row.priority)],
            ["catch up", row.catch_up], ["enabled", "yes" if row.enabled else "no"], ["source", row.source],
            ["fired", f"{row.fires} run(s), last at {clock(row.last_fire_at) or '-'}"],
        ]
        self.stdout.write(table([line for line in head if line[1]]))
        self.stdout.write(block("payload" if row.handler else "context", row.payload))
        upcoming = timing.upcoming(row.next_fire_at, UPCOMING) if row.enabled else []
        self.stdout.write("\nnext fire times (database clock):" if upcoming else "\nno fire time ahead")
        for tick in upcoming:
            self.stdout.write(f"  {when(tick, now)}")
        runs = list(ScheduleRun.objects.using(using).filter(schedule=row).order_by("-number")[:20])
        if not runs:
            self.stdout.write("\nno runs yet")
            return
        jobs = dict(Job.objects.using(using).filter(pk__in=[r.job_id for r in runs if r.job_id])
                    .values_list("pk", "status"))
        lines = [["RUN", "TICK", "FIRED", "JOB", "STATUS", "DURATION", "ERROR"]]
        for run in runs:
            error = shown(run.error)
            lines.append([
                f"#{run.number}", clock(run.tick_at) or "by hand", clock(run.fired_at),
                f"#{run.job_id}" if run.job_id else "-", schedules.status_of(run, jobs.get(run.job_id)),
                elapsed(run.started_at, run.finished_at, None) or "-",
                error if len(error) <= ERROR_WIDTH else error[: ERROR_WIDTH - 3] + "...",
            ])
        self.stdout.write(f"\nlast {len(runs)} run(s):\n" + table(lines))

    def _queue(self, row: Schedule) -> list[list[str]]:
        """The lines that say where its jobs go and which live workers serve that queue,
        as the leader would push them (see leases.tasks.schedules.serving)."""
        where = place(row, self.using)
        workers = serving(where.queue, self.using)
        hint = "" if where.known else "; define it in an installed app, or --import its module"
        served = f"{len(workers)} live worker(s): " + ", ".join(shown(name) for name in workers[:5]) + (
            " ..." if len(workers) > 5 else "") if workers else (
            f"WARNING: no live worker serves queue {shown(where.queue)}: its jobs wait until one does"
            f" (leases_worker --queue {shown(where.queue)})")
        return [["queue", f"{shown(where.queue)} ({shown(where.why)}{hint})"], ["served by", served]]
