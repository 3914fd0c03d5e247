"""Defining schedules: `schedule()` makes or changes one, checked whole before anything is
written; `unschedule()`, `set_enabled()`; and LEASES_SCHEDULES applied at a worker's start.

A schedule is a row whose `next_fire_at` is its next tick by the database clock; a
changed timing starts again from that clock. Its target is a handler's job, or what an
app registered as a schedule target (`registry.Target`: a pipeline run).
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from leases import clock, conf, db, routing
from leases.encoding import dump_json
from leases.validation import check_name, check_queue

from .. import registry
from ..jobs.payload import check_priority
from ..jobs.queues import queue_settings
from ..models import NAME_LENGTH, Schedule
from .timing import Timing, check_timing

log = logging.getLogger("leases.tasks.scheduler")


def _check_target(handler: Any, pipeline: Any, queue: Any, using: str) -> tuple[str, str, str]:
    """(handler, pipeline, queue) checked: exactly one of handler and pipeline, known here."""
    if bool(handler) == bool(pipeline):
        raise ValueError("give a handler or a pipeline to schedule (one of them)")
    if handler:
        name, what = registry.get(handler).name, ""  # UnknownHandler
        derived = registry.get(handler).queue
    else:
        target = registry.target("pipeline")
        name, what = "", target.check(pipeline)
        derived = target.queue(what) or registry.get(target.handler).queue  # its first tasks' (serving.place)
    if queue is not None:
        queue = check_queue(queue)
        queue_settings(queue, using)  # a queue no worker serves is a mistake
    routing.check_queue_on(queue or derived, using, "schedule")
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
    priority = check_priority(priority)
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
            now = clock.now(cursor)
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


def locked(name: str, using: str) -> Schedule:
    """The schedule `name`, its row locked for the caller's transaction; ValueError if none."""
    row = Schedule.objects.using(using).select_for_update().filter(name=name).first()
    if row is None:
        raise ValueError(f"no schedule named {name!r}")
    return row


def set_enabled(name: str, enabled: bool, using: str | None = None) -> bool:
    """Enable (its next tick counted from now) or disable a schedule; False if unchanged."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> bool:
        with db.write_transaction(using):
            row = locked(name, using)
            if row.enabled == enabled:
                return False
            now = clock.now(cursor)
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
    wanted = conf.schedules()
    for name, spec in wanted.items():
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
