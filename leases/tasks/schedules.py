"""Recurring and one-off jobs and pipeline runs: definitions, ticks, and the pass that
fires them (run by the leading worker, see `leases.tasks.scheduler`).

A schedule is a row whose `next_fire_at` is its next tick by the database clock. A pass
locks a batch of due rows (FOR UPDATE SKIP LOCKED, so an overlapping leader takes
others) and, in the same transaction, works out each one's ticks to fire under its
catch-up policy, moves `next_fire_at` past them, pushes one job per tick with the key
`schedule:<name>:<tick>` and records a run per tick. A run's (schedule, tick) is unique:
one job per tick is structural, whatever two leaders do. The run learns how its job
ended from the statement that ends it (a finisher, as pipeline tasks do).

Cron expressions are evaluated in the schedule's time zone by cronsim, with Debian
cron's rules across DST changes: a wall-clock time that happens twice fires once, one
that does not exist fires once, at the next valid minute.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from django.conf import settings
from django.db import connections

from leases import db, routing
from leases.sql import in_list, statements, update_each
from leases.validation import check_name, dump_json

from . import queue as jobqueue
from . import registry
from .models import NAME_LENGTH, Job, JobError, Schedule, ScheduleRun

log = logging.getLogger("leases.tasks.scheduler")

#: The on_finish of a scheduled job: its run records how it ended (`runs_ended`).
RUN_ENDED = "leases.tasks.schedule_run_ended"
#: The handler that starts a scheduled pipeline run (leases.pipelines registers it).
START_PIPELINE = "leases.pipelines.start"
#: Schedules fired per transaction of a pass.
BATCH = 200
#: Most ticks catch_up="all" fires at once after a long stop (the newest ones).
CATCH_UP_MAX = 1000
#: With catch_up="none", a tick later than this is missed, not late (seconds).
LATE_AFTER = 60.0
#: Shortest interval of an `every` schedule (the passes run about twice a second).
MIN_EVERY = 1.0
#: Schedules of settings.LEASES_SCHEDULES accept these keys.
SETTING_KEYS = {"handler", "pipeline", "cron", "every", "at", "timezone", "payload", "context", "queue",
                "priority", "enabled", "catch_up"}


# -- timing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """When a schedule's ticks fall: a cron expression in a time zone, every N seconds from
    its first tick, or once at a moment. All times are aware, in UTC."""

    cron: str = ""
    every: float | None = None
    at: datetime | None = None
    timezone: str = "UTC"

    @classmethod
    def of(cls, row: Schedule) -> Timing:
        return cls(row.cron, row.every, row.at, row.timezone)

    def first(self, now: datetime) -> datetime | None:
        """The first tick of a schedule made (or re-timed, or enabled) at `now`."""
        if self.at is not None:
            return self.at if self.at > now else None
        if self.every is not None:
            return now + timedelta(seconds=self.every)
        return self.after(now)

    def after(self, moment: datetime) -> datetime | None:
        """The first tick strictly after `moment` (a tick of the sequence through it)."""
        if self.at is not None:
            return None  # a one-off has no tick after its own
        if self.every is not None:
            return moment + timedelta(seconds=self.every)
        return next(self._cron(moment), None)

    def due(self, first: datetime, now: datetime, limit: int) -> list[datetime]:
        """The ticks from `first` (a tick) to `now`, at most the newest `limit` of them."""
        if first > now:
            return []
        if self.at is not None:
            return [first]
        if self.every is not None:
            step = timedelta(seconds=self.every)
            count = int((now - first) / step) + 1
            start = max(0, count - limit)
            return [first + step * index for index in range(start, count)]
        newest: list[datetime] = []
        for tick in self._cron(now + timedelta(seconds=1), reverse=True):
            if tick < first or len(newest) == limit:
                break
            if tick <= now:
                newest.append(tick)
        return newest[::-1] or [first]

    def upcoming(self, start: datetime | None, count: int) -> list[datetime]:
        """`start` (a schedule's next tick) and the ticks after it, `count` in all."""
        found: list[datetime] = []
        tick = start
        while tick is not None and len(found) < count:
            found.append(tick)
            tick = self.after(tick)
        return found

    def _cron(self, moment: datetime, reverse: bool = False) -> Iterator[datetime]:
        zone = ZoneInfo(self.timezone)
        local = moment.astimezone(zone).replace(microsecond=0)
        for tick in CronSim(self.cron, local, reverse=reverse):
            yield tick.astimezone(UTC)

    def describe(self) -> str:
        """The timing in words, as operators read it."""
        if self.at is not None:
            return f"once at {self.at:%Y-%m-%d %H:%M:%S}Z"
        if self.every is not None:
            return f"every {_interval(self.every)}"
        try:
            words = CronSim(self.cron, datetime(2000, 1, 1)).explain()
        except Exception:  # noqa: BLE001 - cronsim cannot put every expression in words
            words = self.cron
        return words + (f" ({self.timezone})" if self.timezone != "UTC" else "")


def _interval(seconds: float) -> str:
    """90 -> 1m30s, 3600 -> 1h, 86400 -> 1d: an interval as operators write it."""
    if seconds != int(seconds) or seconds < 60:
        return f"{seconds:g}s"
    parts, left = [], int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts)


def _timezone(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"timezone must be a time zone name such as 'Europe/Berlin', not {name!r}")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}") from None
    return name


def check_timing(cron: Any = None, every: Any = None, at: Any = None, timezone: Any = None,
                 now: datetime | None = None) -> Timing:
    """The timing of a schedule, or ValueError with one line: exactly one of cron, every
    and at; a cron expression cronsim accepts; every of at least MIN_EVERY seconds; an
    aware `at` in the future (by `now`, the database clock)."""
    given = [name for name, value in (("cron", cron), ("every", every), ("at", at)) if value not in (None, "")]
    if len(given) != 1:
        raise ValueError(f"give exactly one of cron, every and at (got {', '.join(given) or 'none'})")
    zone = _timezone(timezone or settings.TIME_ZONE or "UTC")
    if cron not in (None, ""):
        if not isinstance(cron, str):
            raise ValueError(f"cron must be a string such as '0 3 * * *', not {cron!r}")
        check_name(cron, "cron", NAME_LENGTH)
        if len(cron.split()) != 5:
            raise ValueError(f"cron expression {cron!r} must have five fields: minute hour day month weekday")
        try:
            CronSim(cron, datetime(2000, 1, 1))
        except CronSimError as exc:
            raise ValueError(f"invalid cron expression {cron!r}: {exc}") from None
        return Timing(cron=cron, timezone=zone)
    if every not in (None, ""):
        seconds = every.total_seconds() if isinstance(every, timedelta) else every
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds == seconds:
            raise ValueError(f"every must be a number of seconds or a timedelta, not {every!r}")
        if seconds < MIN_EVERY or seconds > 10 * 365 * 86400:
            raise ValueError(f"every must be from {MIN_EVERY:g} second to ten years, not {seconds!r}")
        return Timing(every=float(seconds), timezone=zone)
    if not isinstance(at, datetime):
        raise ValueError(f"at must be a datetime, not {at!r}")
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"at must be an aware datetime (with a time zone), not {at.isoformat()}")
    at = at.astimezone(UTC)
    if now is not None and at <= now:
        raise ValueError(f"at {at.isoformat()} is in the past (the database clock says {now.isoformat()})")
    return Timing(at=at, timezone=zone)


# -- defining ---------------------------------------------------------------------------


def _now(cursor: Any) -> datetime:
    cursor.execute(statements(cursor.db).now, ())
    return db.to_datetime(cursor.fetchone()[0])


def _check_target(handler: Any, pipeline: Any, queue: Any, using: str) -> tuple[str, str, str]:
    """(handler, pipeline, queue) checked: exactly one of handler and pipeline, known here."""
    if bool(handler) == bool(pipeline):
        raise ValueError("give a handler or a pipeline to schedule (one of them)")
    if handler:
        spec = registry.get(handler)  # UnknownHandler
        name, what = spec.name, ""
    else:
        from django.apps import apps

        if not apps.is_installed("leases.pipelines"):
            raise ValueError("scheduling a pipeline needs the leases.pipelines app in INSTALLED_APPS")
        from leases.pipelines.definition import get

        name, what = "", get(pipeline).name  # ValueError naming the known ones
        registry.get(START_PIPELINE)
    if queue is not None:
        queue = registry.check_queue(queue)
        jobqueue.queue_settings(queue, using)  # a queue no worker serves is a mistake
    target = queue or (registry.get(name).queue if handler else registry.get(START_PIPELINE).queue)
    routing.check_queue_on(target, using, "schedule")
    return name, what, queue or ""


def check(
    name: str,
    handler: str | None = None,
    *,
    pipeline: str | None = None,
    cron: str | None = None,
    every: float | timedelta | None = None,
    at: datetime | None = None,
    timezone: str | None = None,
    payload: Any = None,
    context: Any = None,
    queue: str | None = None,
    priority: int = 0,
    enabled: bool = True,
    catch_up: str = Schedule.LAST,
    using: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The fields of a schedule as `schedule()` would write them, or ValueError (or
    UnknownHandler) with one line; `now` (the database clock) checks that `at` is ahead."""
    using = db.alias(using)
    check_name(name, "schedule name", NAME_LENGTH)
    handler, pipeline, queue = _check_target(handler, pipeline, queue, using)
    if handler and context is not None:
        raise ValueError("a handler's schedule takes payload, not context")
    if pipeline and payload is not None:
        raise ValueError("a pipeline's schedule takes context, not payload")
    data = payload if handler else context
    data = {} if data is None else data
    dump_json(data, "payload" if handler else "context")
    priority = jobqueue.check_priority(priority)
    if catch_up not in (Schedule.LAST, Schedule.NONE, Schedule.ALL):
        raise ValueError(f"catch_up must be 'last', 'none' or 'all', not {catch_up!r}")
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, not {enabled!r}")
    timing = check_timing(cron, every, at, timezone, now)
    return {
        "name": name, "handler": handler, "pipeline": pipeline, "cron": timing.cron, "every": timing.every,
        "at": timing.at, "timezone": timing.timezone, "payload": data, "queue": queue, "priority": priority,
        "enabled": enabled, "catch_up": catch_up,
    }


def schedule(name: str, handler: str | None = None, *, using: str | None = None, source: str = Schedule.API,
             **options: Any) -> Schedule:
    """Make or update the schedule `name`: `handler` (a job with `payload`) or `pipeline`
    (a run with `context`), on `cron` (in `timezone`, default settings.TIME_ZONE), `every`
    N seconds or once `at`; `queue`, `priority`, `enabled` and `catch_up` ("last", "none",
    "all") as `check()` takes them. Everything is checked before anything is written; a
    changed timing starts again from the database clock."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> Schedule:
        with db.write_transaction(using):
            now = _now(cursor)
            fields = check(name, handler, using=using, now=now, **options)
            fields.update(source=source, updated_at=now)
            timing, enabled = Timing(fields["cron"], fields["every"], fields["at"], fields["timezone"]), fields["enabled"]
            row = Schedule.objects.using(using).select_for_update().filter(name=name).first()
            if row is None:
                row = Schedule(created_at=now, **fields)
                row.next_fire_at = timing.first(now) if enabled else None
                row.save(using=using)
                return row
            retimed = Timing.of(row) != timing or (enabled and not row.enabled)
            for field, value in fields.items():
                setattr(row, field, value)
            if not enabled:
                row.next_fire_at = None
            elif retimed or row.next_fire_at is None and timing.at is None:
                row.next_fire_at = timing.first(now)
            row.save(using=using)
            return row

    return db.run(work, using)


def unschedule(name: str, using: str | None = None) -> bool:
    """Remove the schedule `name` and its history; False if there was none. Jobs it
    already pushed run as any other."""
    using = db.alias(using)
    deleted, _ = Schedule.objects.using(using).filter(name=name).delete()
    return deleted > 0


def set_enabled(name: str, enabled: bool, using: str | None = None) -> bool:
    """Enable (its next tick counted from now) or disable a schedule; False if unchanged."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> bool:
        with db.write_transaction(using):
            row = Schedule.objects.using(using).select_for_update().filter(name=name).first()
            if row is None:
                raise ValueError(f"no schedule named {name!r}")
            if row.enabled == enabled:
                return False
            now = _now(cursor)
            row.enabled = enabled
            row.next_fire_at = Timing.of(row).first(now) if enabled else None
            row.updated_at = now
            row.save(using=using, update_fields=["enabled", "next_fire_at", "updated_at"])
            return True

    return db.run(work, using)


def apply_settings(using: str | None = None) -> list[str]:
    """Make the schedules of settings.LEASES_SCHEDULES and remove those that came from it
    and are gone from it; returns the names applied. Checked whole before any is written."""
    using = db.alias(using)
    wanted = getattr(settings, "LEASES_SCHEDULES", {}) or {}
    if not isinstance(wanted, dict):
        raise ValueError("LEASES_SCHEDULES must be a dict of name -> {handler or pipeline, cron/every/at, ...}")
    for name, spec in wanted.items():
        if not isinstance(spec, dict):
            raise ValueError(f"LEASES_SCHEDULES[{name!r}] must be a dict")
        unknown = set(spec) - SETTING_KEYS
        if unknown:
            raise ValueError(f"LEASES_SCHEDULES[{name!r}]: unknown key(s) {', '.join(sorted(unknown))}")
        check_name(name, "schedule name", NAME_LENGTH)
        _check_target(spec.get("handler"), spec.get("pipeline"), spec.get("queue"), using)
        check_timing(spec.get("cron"), spec.get("every"), spec.get("at"), spec.get("timezone"))
    for name, spec in wanted.items():
        try:
            schedule(name, spec.get("handler"), using=using, source=Schedule.SETTINGS,
                     **{key: value for key, value in spec.items() if key != "handler"})
        except ValueError as exc:
            raise ValueError(f"LEASES_SCHEDULES[{name!r}]: {exc}") from None
    gone = Schedule.objects.using(using).filter(source=Schedule.SETTINGS).exclude(name__in=list(wanted))
    for name in gone.values_list("name", flat=True):
        log.info("schedule %s removed: it is no longer in LEASES_SCHEDULES", name)
    gone.delete()
    return list(wanted)


# -- firing -----------------------------------------------------------------------------


def plan(row: Schedule, now: datetime) -> tuple[list[datetime], datetime | None]:
    """(the ticks to fire at `now`, the next tick after them) under the row's catch-up
    policy: "last" fires the newest due tick once, "all" every due tick (the newest
    CATCH_UP_MAX), "none" the newest only if it is at most LATE_AFTER seconds late."""
    timing = Timing.of(row)
    due = timing.due(row.next_fire_at, now, CATCH_UP_MAX if row.catch_up == Schedule.ALL else 1)
    if not due:
        return [], row.next_fire_at
    following = timing.after(due[-1])
    if following is not None and following <= now:  # cannot happen; never fire in a loop
        following = timing.after(now)
    if row.catch_up == Schedule.NONE and (now - due[-1]).total_seconds() > LATE_AFTER:
        return [], following
    return due, following


def _job(row: Schedule, key: str) -> jobqueue.NewJob:
    """The job a tick of `row` pushes: the handler's with the payload, or the start of the
    pipeline with the context (the run's key is the tick's, so a retried start finds it)."""
    name = row.handler or START_PIPELINE
    spec = registry.find(name)
    if row.handler:
        payload = row.payload
    else:
        payload = {"pipeline": row.pipeline, "context": row.payload, "key": key}
    return jobqueue.NewJob(
        queue=row.queue or (spec.queue if spec else "default"), name=name, payload=json.dumps(payload),
        key=key, priority=row.priority, max_attempts=spec.max_attempts if spec else 1, on_finish=RUN_ENDED,
    )


def tick_key(row: Schedule, tick: datetime | None, now: datetime) -> str:
    """schedule:<name>:<tick>, or :manual:<time> for a run fired by hand."""
    if tick is None:
        return f"schedule:{row.name}:manual:{now.isoformat()}"
    return f"schedule:{row.name}:{tick.isoformat()}"


def _push(fired: list[tuple[Schedule, datetime | None, int]], now: datetime, using: str) -> int:
    """Push one job per (schedule, tick, run number) and record its run, in the caller's
    transaction (the schedules' `fires` already count them); then trim their history."""
    connection = connections[using]
    jobs = [_job(row, tick_key(row, tick, now)) for row, tick, _ in fired]
    with connection.cursor() as cursor:
        jobqueue.write(cursor, jobs)
    ids = dict(Job.objects.using(using).filter(pending_key__in=[job.key for job in jobs])
               .values_list("pending_key", "id"))
    ScheduleRun.objects.using(using).bulk_create(
        ScheduleRun(schedule=row, number=number, tick_at=tick, fired_at=now, job_id=ids.get(job.key))
        for (row, tick, number), job in zip(fired, jobs)
    )
    schedules = sorted({row.pk for row, _, _ in fired})
    with connection.cursor() as cursor:
        cursor.execute(statements(connection, "schedule").trim + in_list(schedules), [jobqueue.keep_runs(), *schedules])
    return len(jobs)


def fire_due(now: datetime | None = None, using: str | None = None) -> int:
    """Fire the due ticks of enabled schedules, a batch per transaction; returns the jobs
    pushed. `now` defaults to the database clock (tests pass their own)."""
    return fire_some(now=now, using=using)[0]


def fire_some(now: datetime | None = None, using: str | None = None,
              budget: float | None = None) -> tuple[int, bool]:
    """(jobs pushed, whether more may be due): fire batches until none is due or, with
    `budget`, until that many seconds have gone, so a worker's loop (heartbeats,
    outcomes) is never held up for long by thousands of schedules due at once."""
    using = db.alias(using)
    deadline = None if budget is None else time.monotonic() + budget

    def work(cursor: Any, resumed: bool) -> tuple[int, int]:
        with db.write_transaction(using):
            clock = now or _now(cursor)
            rows = list(
                Schedule.objects.using(using).select_for_update(skip_locked=True)
                .filter(enabled=True, next_fire_at__lte=clock).order_by("next_fire_at")[:BATCH]
            )
            if not rows:
                return 0, 0
            fired: list[tuple[Schedule, datetime | None, int]] = []
            moves: dict[int, dict[str, Any]] = {}
            for row in rows:
                ticks, following = plan(row, clock)
                if len(ticks) == CATCH_UP_MAX:
                    log.warning("schedule %s: catching up on its newest %d ticks only", row.name, CATCH_UP_MAX)
                fired += [(row, tick, row.fires + number) for number, tick in enumerate(ticks, 1)]
                row.fires += len(ticks)
                moves[row.pk] = {"next_fire_at": following, "last_fire_at": ticks[-1] if ticks else row.last_fire_at,
                                 "fires": row.fires}
            connection = connections[using]
            update_each(connection, db.table(Schedule, connection), moves)
            pushed = _push(fired, clock, using) if fired else 0
            return pushed, len(rows)

    total = 0
    while True:
        pushed, seen = db.run(work, using)
        total += pushed
        if seen < BATCH:
            return total, False
        if deadline is not None and time.monotonic() >= deadline:
            return total, True


def fire_now(name: str, using: str | None = None) -> ScheduleRun:
    """Fire a run of `name` now, outside its tick sequence (`schedule run NAME`)."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> ScheduleRun:
        with db.write_transaction(using):
            row = Schedule.objects.using(using).select_for_update().filter(name=name).first()
            if row is None:
                raise ValueError(f"no schedule named {name!r}")
            now = _now(cursor)
            row.fires += 1
            Schedule.objects.using(using).filter(pk=row.pk).update(fires=row.fires)
            _push([(row, None, row.fires)], now, using)
            return ScheduleRun.objects.using(using).get(schedule=row, number=row.fires)

    return db.run(work, using)


# -- how runs end -----------------------------------------------------------------------

def runs_ended(cursor: Any, ended: list[tuple[int, str]]) -> None:
    """The finisher of scheduled jobs: copy how each ended to its run ("discarded" for a
    job deleted while it waited), in the transaction that ended it; a failed one's last
    error too."""
    ids = [job_id for job_id, _ in ended]
    st = statements(cursor.db, "schedule")
    cursor.execute(st.ended + in_list(ids), ids)
    cursor.execute(st.failed + in_list(ids), ids)
    failed = [row[0] for row in cursor.fetchall()]
    if not failed:
        return
    using = cursor.db.alias
    errors = JobError.objects.using(using).filter(job_id__in=failed).order_by("job_id", "-attempt", "-id")
    last: dict[int, str] = {}
    for job_id, exception, message in errors.values_list("job_id", "exception", "message"):
        last.setdefault(job_id, f"{exception.rsplit('.', 1)[-1]}: {message}"[:10000])
    runs = ScheduleRun.objects.using(using).filter(job_id__in=failed).values_list("pk", "job_id")
    update_each(cursor.db, db.table(ScheduleRun, cursor.db), {pk: {"error": last.get(job, "")} for pk, job in runs})


def status_of(run: ScheduleRun, job_status: int | None) -> str:
    """A run's status for operators: as recorded, or its job's while it waits or runs."""
    if run.status != ScheduleRun.QUEUED or job_status is None:
        return run.status
    return "running" if job_status == Job.RUNNING else "queued"

