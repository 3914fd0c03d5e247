"""Firing schedules: the pass the leading worker runs (`leader`), and how a run learns
how its job ended.

A pass locks a batch of due rows (FOR UPDATE SKIP LOCKED, so an overlapping leader takes
others) and, in the same transaction, works out each one's ticks to fire under its
catch-up policy, moves `next_fire_at` past them, pushes one job per tick with the key
`schedule:<name>:<tick>` through the one maker of job rows (so the handler's queue,
attempts and limits apply) and records a run per tick: a few statements per batch,
whatever its size. A run's (schedule, tick) is unique: one job per tick is structural,
whatever two leaders do. A burst (thousands due at once) is fired by LANES connections
side by side, which take batches as overlapping leaders would; each trims the history
of the schedules it fired once it has pushed them. The run learns how its job ended
from the statement that ends it (a finisher, as pipeline tasks do).

A job goes on the queue `serving.place` names. With catch_up="none" a schedule keeps one
job waiting at most: a tick that finds the job of the schedule's last run not yet
claimed by any worker is skipped (one statement per batch, by the runs' (schedule,
number) index), so ticks fired while no worker serves the queue do not pile up and
start together when one comes.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

from django.db import connections

from leases import clock, conf, db
from leases.encoding import load_json
from leases.sql import in_list, update_each

from .. import registry, sql
from ..jobs.outcomes import last_errors
from ..jobs.push import BATCH_CHARS, JobDefaults, NewJob, new_job, write
from ..models import Job, Schedule, ScheduleRun
from .define import locked
from .serving import Place, place
from .timing import Timing

log = logging.getLogger("leases.tasks.scheduler")

#: The on_finish of a scheduled job: its run records how it ended (`runs_ended`).
RUN_ENDED = "leases.tasks.schedule_run_ended"
#: Schedules fired per transaction of a pass: each batch commits before the next starts,
#: so the first ticks of a burst do not wait for the last.
BATCH = 500
#: Most jobs (and runs) per statement, however many ticks a batch fires (catch_up="all"),
#: below the 1,000 values from which MariaDB reads an IN list as a table to join.
PER_STATEMENT = 500
#: Connections that fire a burst side by side (where rows can be locked and skipped).
LANES = 2
#: Most ticks catch_up="all" fires at once after a long stop (the newest ones).
CATCH_UP_MAX = 1000
#: With catch_up="none", a tick later than this is missed, not late (seconds).
LATE_AFTER = 60.0

#: What the leader last said of each schedule (its job's fallback queue, its waiting
#: job), so that a line is said once, not at every tick.
_said: dict[tuple[str, str], object] = {}


class Due(NamedTuple):
    """A due schedule as a pass reads it: the columns firing needs, without the cost of a
    model instance per row (a burst is thousands of them)."""

    pk: int
    name: str
    handler: str
    pipeline: str
    cron: str
    every: float | None
    at: datetime | None
    timezone: str
    payload: Any
    queue: str
    priority: int
    catch_up: str
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    fires: int


def _moment(value: Any) -> datetime | None:
    return None if value is None else db.to_datetime(value)


def _due(cursor: Any, moment: datetime, limit: int) -> list[Due]:
    """The due schedules of `moment`, soonest first, at most `limit`, locked for the pass."""
    cursor.execute(sql.schedules(cursor.db).due, (True, db.dialect(cursor.db).stored_datetime(moment), limit))
    return [
        Due(pk, name, handler, pipeline, cron, every, _moment(at), zone, load_json(payload), queue, priority,
            catch_up, _moment(next_at), _moment(last_at), fires)
        for (pk, name, handler, pipeline, cron, every, at, zone, payload, queue, priority, catch_up, next_at,
             last_at, fires) in cursor.fetchall()
    ]


def plan(row: Schedule | Due, now: datetime) -> tuple[list[datetime], datetime | None]:
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


def _job(row: Schedule | Due, key: str, where: Place) -> NewJob:
    """The job a tick of `row` pushes on `where`'s queue: the handler's with the payload,
    or the job that starts its target (a pipeline run) with the context; the run's key
    is the tick's, so a retried start finds it."""
    if row.handler:
        name, payload = row.handler, row.payload
    else:
        target = registry.target("pipeline")
        name, payload = target.handler, target.payload(row.pipeline, row.payload, key)
    return new_job(name, payload, queue=where.queue, key=key, priority=row.priority, on_finish=RUN_ENDED,
                   settings=registry.find(name) or JobDefaults())


def _place(row: Schedule | Due, using: str, found: dict[tuple[str, str, str], Place]) -> Place:
    """`serving.place` of `row`, once per (handler, pipeline, queue) of a batch; a
    fallback is said once per schedule, as what it falls back from changes."""
    what = (row.handler, row.pipeline, row.queue)
    if what not in found:
        found[what] = place(row, using)
    where = found[what]
    if not where.known and _said.get((row.name, "place")) != where:
        _said[(row.name, "place")] = where
        log.warning("schedule %s: its jobs go on queue %r: %s (define it in an installed app, or --import its"
                    " module in every worker that may lead)", row.name, where.queue, where.why)
    return where


def tick_key(row: Schedule | Due, tick: datetime | None, now: datetime) -> str:
    """schedule:<name>:<tick>, or :manual:<time> for a run fired by hand."""
    if tick is None:
        return f"schedule:{row.name}:manual:{now.isoformat()}"
    return f"schedule:{row.name}:{tick.isoformat()}"


# -- a batch's statements ---------------------------------------------------------------


def _move(cursor: Any, rows: list[Due], moves: dict[int, tuple[datetime | None, datetime | None, int]]) -> None:
    """Set each schedule's (next tick, last tick) and add the ticks it fired to `fires`,
    in one statement: JSON records on PostgreSQL; elsewhere one value per column when
    every schedule of the batch shares them, else a CASE by id."""
    connection = cursor.db
    st, stored = sql.schedules(connection), db.dialect(connection).stored_datetime
    ids = list(moves)
    if db.dialect(connection).arrays:
        cursor.execute(st.move_records, (_records(
            {"id": pk, "next": following, "last": last, "added": added}
            for pk, (following, last, added) in moves.items()
        ),))
        return
    shared = set(moves.values())
    if len(shared) == 1:
        following, last, added = shared.pop()
        cursor.execute(st.move + in_list(ids), [None if following is None else stored(following),
                                                 None if last is None else stored(last), added, *ids])
        return
    columns = ("next_fire_at", "last_fire_at", "fires")
    update_each(connection, db.table(Schedule, connection), {
        row.pk: dict(zip(columns, (following, last, row.fires + added)))
        for row, (following, last, added) in zip(rows, moves.values())
    })


def _record(cursor: Any, fired: Sequence[tuple[Schedule | Due, datetime | None, int]], jobs: Sequence[NewJob],
            now: datetime, ids: dict[str, int]) -> None:
    """A run per fired tick, naming the job its key holds in this transaction (`ids`, by
    key; on PostgreSQL found by the same statement)."""
    connection = cursor.db
    st, stored = sql.schedules(connection), db.dialect(connection).stored_datetime
    if db.dialect(connection).arrays:
        cursor.execute(st.runs_records, (stored(now), _records(
            {"schedule": row.pk, "number": number, "tick": tick, "job_key": job.key}
            for (row, tick, number), job in zip(fired, jobs)
        )))
        return
    ticks = [None if tick is None else stored(tick) for _, tick, _ in fired]
    at = stored(now)
    params: list = []
    for (row, _, number), tick, job in zip(fired, ticks, jobs):
        params += [row.pk, number, tick, at, ids.get(job.key)]
    cursor.execute(st.runs + ", ".join([st.run_values] * len(jobs)), params)


def _push(cursor: Any, fired: list[tuple[Schedule | Due, datetime | None, int]], now: datetime) -> int:
    """Push one job per (schedule, tick, run number) and record its run, in the caller's
    transaction (the schedules' `fires` already count them)."""
    found: dict[tuple[str, str, str], Place] = {}
    jobs = [_job(row, tick_key(row, tick, now), _place(row, cursor.db.alias, found)) for row, tick, _ in fired]
    for part in _parts(jobs):
        ids = write(cursor, jobs[part], ids=not db.dialect(cursor.db).arrays)
        _record(cursor, fired[part], jobs[part], now, ids)
    return len(fired)


def _records(rows: Iterable[dict[str, Any]]) -> str:
    """Rows as one JSON text for jsonb_to_recordset (see leases.tasks.sql.schedules)."""
    return json.dumps(list(rows), default=datetime.isoformat)


def _parts(jobs: Sequence[NewJob]) -> Iterator[slice]:
    """Runs of at most PER_STATEMENT jobs and BATCH_CHARS of payload (or one job): a
    statement each, well under MySQL's max_allowed_packet."""
    start, size = 0, 0
    for index, job in enumerate(jobs):
        if index > start and (index - start == PER_STATEMENT or size + len(job.payload) > BATCH_CHARS):
            yield slice(start, index)
            start, size = index, 0
        size += len(job.payload)
    if start < len(jobs):
        yield slice(start, len(jobs))


def _trim(cursor: Any, fires: dict[int, int]) -> None:
    """Keep the newest LEASES_KEEP_RUNS runs of schedules that have fired `fires` runs:
    drop those numbered up to `fires` - N, through the (schedule, number) index."""
    keep = conf.keep_runs()
    upto = {pk: count - keep for pk, count in sorted(fires.items()) if count > keep}
    if not upto:
        return
    st = sql.schedules(cursor.db)
    if db.dialect(cursor.db).arrays:
        cursor.execute(st.trim_records, (_records({"schedule": pk, "upto": number} for pk, number in upto.items()),))
        return
    cursor.execute(st.trim + " OR ".join([st.trim_one] * len(upto)), [value for pair in upto.items() for value in pair])


def _trim_history(using: str, fires: dict[int, int]) -> None:
    """`_trim` once a lane has pushed its batches, so no tick waits for it: PER_STATEMENT
    schedules a statement, each its own transaction. Runs a lost reply leaves unknown
    are trimmed when their schedule fires next."""
    items = sorted(fires.items())
    for start in range(0, len(items), PER_STATEMENT):
        part = dict(items[start:start + PER_STATEMENT])
        db.run(lambda cursor, resumed, part=part: _trim(cursor, part), using)


# -- passes -----------------------------------------------------------------------------


def fire_due(now: datetime | None = None, using: str | None = None) -> int:
    """Fire the due ticks of enabled schedules, a batch per transaction; returns the jobs
    pushed. `now` defaults to the database clock (tests pass their own)."""
    return fire_some(now=now, using=using)[0]


def fire_some(now: datetime | None = None, using: str | None = None,
              budget: float | None = None) -> tuple[int, bool]:
    """(jobs pushed, whether more may be due): fire batches until none is due or, with
    `budget`, until that many seconds have gone, so a worker's loop (heartbeats,
    outcomes) is never held up for long by thousands of schedules due at once. A burst
    (a full batch due) is fired by LANES connections side by side."""
    using = db.alias(using)
    deadline = None if budget is None else time.monotonic() + budget
    fires: dict[int, int] = {}
    pushed, seen = _batch(using, now, fires)
    if seen < BATCH or _past(deadline):
        _trim_history(using, fires)
        return pushed, seen == BATCH
    connection = connections[using]
    side_by_side = connection.features.has_select_for_update_skip_locked and not connection.in_atomic_block
    lanes = [_Lane(using, now, deadline) for _ in range(LANES - 1)] if side_by_side else []
    try:
        outcomes = [_lane(using, now, deadline, fires)]
    finally:
        for lane in lanes:
            lane.join()
    outcomes += [lane.outcome() for lane in lanes]
    return pushed + sum(count for count, _ in outcomes), any(more for _, more in outcomes)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _lane(using: str, now: datetime | None, deadline: float | None,
          fires: dict[int, int] | None = None) -> tuple[int, bool]:
    """Fire batches until fewer than a batch are due or the deadline has passed, then
    trim the history of the schedules fired (those in `fires` too): (pushed, more)."""
    fires = {} if fires is None else fires
    total = 0
    while True:
        pushed, seen = _batch(using, now, fires)
        total += pushed
        if seen < BATCH or _past(deadline):
            break
    _trim_history(using, fires)
    return total, seen == BATCH


class _Lane(threading.Thread):
    """A connection of its own firing batches beside the caller's during a burst: while
    the database writes one lane's batch, this process makes the other's. Their passes
    take different rows (SKIP LOCKED), as two leaders' would."""

    def __init__(self, using: str, now: datetime | None, deadline: float | None) -> None:
        super().__init__(name="leases-scheduler-lane", daemon=True)
        self.using, self.now, self.deadline = using, now, deadline
        self.result: tuple[int, bool] = (0, False)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = _lane(self.using, self.now, self.deadline)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            self.error = exc
        finally:
            connections.close_all()  # this thread's own

    def outcome(self) -> tuple[int, bool]:
        if self.error is not None:
            raise self.error
        return self.result


def _waiting(cursor: Any, rows: list[Due]) -> dict[int, int]:
    """{schedule id: job id} of those of `rows` whose last run's job no worker has claimed
    yet (ready or blocked, never claimed): the schedules' numbers are their last runs'."""
    if not rows:
        return {}
    st = sql.schedules(cursor.db)
    if db.dialect(cursor.db).arrays:
        cursor.execute(st.waiting_records, (_records({"schedule": row.pk, "number": row.fires} for row in rows),))
    else:
        cursor.execute(st.waiting + " OR ".join([st.waiting_one] * len(rows)) + ")",
                       [value for row in rows for value in (row.pk, row.fires)])
    return dict(cursor.fetchall())


def _batch(using: str, now: datetime | None, fires: dict[int, int]) -> tuple[int, int]:
    """Fire a batch of due schedules in a transaction of its own: (jobs pushed, schedules
    seen); `fires` learns the run count of each schedule that fired, once committed. A
    retry after a lost reply finds the rows a committed try moved on."""

    def work(cursor: Any, resumed: bool) -> tuple[int, int, dict[int, int], list[tuple[Due, datetime, int]]]:
        with db.write_transaction(using):
            moment = now or clock.now(cursor)
            rows = _due(cursor, moment, BATCH)
            if not rows:
                return 0, 0, {}, []
            plans = {row.pk: plan(row, moment) for row in rows}
            waiting = _waiting(cursor, [row for row in rows if plans[row.pk][0] and row.catch_up == Schedule.NONE
                                        and row.fires])
            fired: list[tuple[Schedule | Due, datetime | None, int]] = []
            moves: dict[int, tuple[datetime | None, datetime | None, int]] = {}
            skipped = [(row, plans[row.pk][0][-1], waiting[row.pk]) for row in rows if row.pk in waiting]
            for row in rows:
                ticks, following = plans[row.pk]
                if row.pk in waiting:
                    ticks = []  # its last job still waits: one waiting job at most
                if len(ticks) == CATCH_UP_MAX:
                    log.warning("schedule %s: catching up on its newest %d ticks only", row.name, CATCH_UP_MAX)
                fired += [(row, tick, row.fires + number) for number, tick in enumerate(ticks, 1)]
                moves[row.pk] = (following, ticks[-1] if ticks else row.last_fire_at, len(ticks))
            _move(cursor, rows, moves)
            pushed = _push(cursor, fired, moment) if fired else 0
            return pushed, len(rows), {row.pk: number for row, _, number in fired}, skipped

    pushed, seen, counts, skipped = db.run(work, using)
    fires.update(counts)
    for row, tick, job_id in skipped:
        if _said.get((row.name, "waiting")) != job_id:  # once per waiting job
            _said[(row.name, "waiting")] = job_id
            log.warning("schedule %s: tick %s skipped, and its next ones until job #%d of its last run is claimed"
                        " (catch_up none keeps one job waiting); does a live worker serve its queue? (manage.py"
                        " schedule show %s)", row.name, f"{tick:%Y-%m-%d %H:%M:%S}Z", job_id, row.name)
    return pushed, seen


def until_due(using: str | None = None) -> float | None:
    """Seconds until the soonest tick of an enabled schedule by the database clock (0 or
    less: one is due), None if none has a next tick: when the leader's next pass is due."""

    def work(cursor: Any, resumed: bool) -> float | None:
        cursor.execute(sql.schedules(cursor.db).next_due, (True,))
        soonest, now = cursor.fetchone()
        return None if soonest is None else (db.to_datetime(soonest) - db.to_datetime(now)).total_seconds()

    return db.run(work, using)


def fire_now(name: str, using: str | None = None) -> ScheduleRun:
    """Fire a run of `name` now, outside its tick sequence (`schedule run NAME`)."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> ScheduleRun:
        with db.write_transaction(using):
            row = locked(name, using)
            now = clock.now(cursor)
            row.fires += 1
            Schedule.objects.using(using).filter(pk=row.pk).update(fires=row.fires)
            _push(cursor, [(row, None, row.fires)], now)
            _trim(cursor, {row.pk: row.fires})
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
