"""Firing schedules: the pass the leading worker runs (`leader`), and how a run learns
how its job ended.

A pass locks a batch of due rows (FOR UPDATE SKIP LOCKED, so an overlapping leader takes
others) and, in the same transaction, works out each one's ticks to fire under its
catch-up policy, moves `next_fire_at` past them, pushes one job per tick with the key
`schedule:<name>:<tick>` through the one maker of job rows (so the handler's queue,
attempts and limits apply) and records a run per tick. A run's (schedule, tick) is
unique: one job per tick is structural, whatever two leaders do. The run learns how its
job ended from the statement that ends it (a finisher, as pipeline tasks do).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from django.db import connections

from leases import clock, conf, db
from leases.sql import in_list, update_each

from .. import registry, sql
from ..jobs.outcomes import last_errors
from ..jobs.push import JobDefaults, NewJob, ids_by_key, new_job, write
from ..models import Job, Schedule, ScheduleRun
from .define import locked
from .timing import Timing

log = logging.getLogger("leases.tasks.scheduler")

#: The on_finish of a scheduled job: its run records how it ended (`runs_ended`).
RUN_ENDED = "leases.tasks.schedule_run_ended"
#: Schedules fired per transaction of a pass.
BATCH = 200
#: Most ticks catch_up="all" fires at once after a long stop (the newest ones).
CATCH_UP_MAX = 1000
#: With catch_up="none", a tick later than this is missed, not late (seconds).
LATE_AFTER = 60.0


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


def _job(row: Schedule, key: str) -> NewJob:
    """The job a tick of `row` pushes: the handler's with the payload, or the job that
    starts its target (a pipeline run) with the context; the run's key is the tick's, so
    a retried start finds it."""
    if row.handler:
        name, payload = row.handler, row.payload
    else:
        target = registry.target("pipeline")
        name, payload = target.handler, target.payload(row.pipeline, row.payload, key)
    return new_job(name, payload, queue=row.queue or None, key=key, priority=row.priority, on_finish=RUN_ENDED,
                   settings=registry.find(name) or JobDefaults())


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
        write(cursor, jobs)
        ids = ids_by_key(cursor, jobs)
    ScheduleRun.objects.using(using).bulk_create(
        ScheduleRun(schedule=row, number=number, tick_at=tick, fired_at=now, job_id=ids.get(job.key))
        for (row, tick, number), job in zip(fired, jobs)
    )
    schedules = sorted({row.pk for row, _, _ in fired})
    with connection.cursor() as cursor:
        cursor.execute(sql.schedules(connection).trim_runs + in_list(schedules), [conf.keep_runs(), *schedules])
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
            moment = now or clock.now(cursor)
            rows = list(
                Schedule.objects.using(using).select_for_update(skip_locked=True)
                .filter(enabled=True, next_fire_at__lte=moment).order_by("next_fire_at")[:BATCH]
            )
            if not rows:
                return 0, 0
            fired: list[tuple[Schedule, datetime | None, int]] = []
            moves: dict[int, dict[str, Any]] = {}
            for row in rows:
                ticks, following = plan(row, moment)
                if len(ticks) == CATCH_UP_MAX:
                    log.warning("schedule %s: catching up on its newest %d ticks only", row.name, CATCH_UP_MAX)
                fired += [(row, tick, row.fires + number) for number, tick in enumerate(ticks, 1)]
                row.fires += len(ticks)
                moves[row.pk] = {"next_fire_at": following, "last_fire_at": ticks[-1] if ticks else row.last_fire_at,
                                 "fires": row.fires}
            connection = connections[using]
            update_each(connection, db.table(Schedule, connection), moves)
            pushed = _push(fired, moment, using) if fired else 0
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
            row = locked(name, using)
            now = clock.now(cursor)
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
    st = sql.schedules(cursor.db)
    cursor.execute(st.runs_ended + in_list(ids), ids)
    cursor.execute(st.failed_jobs + in_list(ids), ids)
    failed = [row[0] for row in cursor.fetchall()]
    if not failed:
        return
    using = cursor.db.alias
    last = last_errors(failed, using)
    runs = ScheduleRun.objects.using(using).filter(job_id__in=failed).values_list("pk", "job_id")
    update_each(cursor.db, db.table(ScheduleRun, cursor.db), {pk: {"error": last.get(job, "")} for pk, job in runs})


def status_of(run: ScheduleRun, job_status: int | None) -> str:
    """A run's status for operators: as recorded, or its job's while it waits or runs."""
    if run.status != ScheduleRun.QUEUED or job_status is None:
        return run.status
    return "running" if job_status == Job.RUNNING else "queued"
