"""What the operators' dashboard and metrics read of the job queue and the dispatchers,
added to them by this app's ready() (see `leases.ops.readings`).

Queue depth is reconstructed from the job rows, one grouped query per window: a job
waited at time t when ``enqueued_at <= t`` and it had not left by t, leaving when it
started (its last claim) or, if it never ran, when it ended. It is an approximation:
only rows still in the table count, so pruned jobs (`leases_prune`, and the runs beyond
LEASES_KEEP_RUNS of a key) are missing; a job now waiting for a retry counts as waiting
since it was first enqueued; a job delayed into the future counts from its push.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    Max,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce

from leases import db
from leases.ops.charts import (
    BLUE,
    DARK_RED,
    DAY,
    GREEN,
    HOUR,
    ORANGE,
    RED,
    Panel,
    Row,
    Series,
    Window,
    columns,
    nothing,
    rows_chart,
)
from leases.ops.readings import WINDOW

from . import sql
from .models import DispatchWorker, Job, PoolTask, Queue, TaskPool

#: One colour per queue in the depth charts, busiest first; the last is for the rest.
QUEUE_COLOURS = ("#4a7fd0", "#9b59b6", "#17a2b8", "#d08700", "#8d6e63", "#7a7a7a")


# -- readings ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Backlog:
    """Jobs not finished, per queue: counts by status name and the oldest due run_at."""

    counts: dict[tuple[str, str], int]
    oldest_due: dict[str, datetime]
    #: Every queue with a row (name: paused), the ones metrics report zeros for.
    queues: dict[str, bool]


def job_backlog(now: datetime, using: str | None = None) -> Backlog:
    """Ready, blocked and running jobs per queue, through the claim index (status, queue,
    ...): its ranges of unfinished rows, never the finished ones. Two queries."""
    using = db.alias(using)
    names = dict(Job.STATUSES)
    rows = (
        Job.objects.using(using).filter(status__in=(Job.READY, Job.BLOCKED, Job.RUNNING))
        .order_by().values("queue", "status")
        .annotate(n=Count("*"), due=Min("run_at", filter=Q(run_at__lte=now)))
    )
    counts, oldest = {}, {}
    for row in rows:
        counts[row["queue"], names[row["status"]]] = row["n"]
        if row["status"] == Job.READY and row["due"] is not None:
            oldest[row["queue"]] = row["due"]
    queues = dict(Queue.objects.using(using).values_list("name", "paused"))
    return Backlog(counts, oldest, queues)


@dataclass(frozen=True)
class Outcomes:
    """Jobs of one (queue, name, status) that finished in a window; `seconds` and
    `longest` are the run time of their last attempt, over the `started` that ran."""

    queue: str
    name: str
    status: str
    count: int
    started: int
    seconds: float
    longest: float


def job_outcomes(since: datetime, now: datetime, using: str | None = None) -> list[Outcomes]:
    """Jobs finished from `since` to `now` by queue, name and status: one grouped query
    over the finished_at index. A job cancelled while waiting never ran: no run time.

    The range is closed on both sides so that SQLite's planner, with no statistics, picks
    the finished_at index instead of scanning the claim index for the GROUP BY's order."""
    took = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    names = dict(Job.STATUSES)
    rows = (
        Job.objects.using(db.alias(using)).filter(finished_at__range=(since, now))
        .order_by().values("queue", "name", "status")
        .annotate(n=Count("*"), started=Count("started_at"), total=Sum(took), longest=Max(took))
    )
    return [
        Outcomes(
            row["queue"], row["name"], names[row["status"]], row["n"], row["started"],
            row["total"].total_seconds() if row["total"] is not None else 0.0,
            row["longest"].total_seconds() if row["longest"] is not None else 0.0,
        )
        for row in rows
    ]


def _per_dispatcher(rows: Any) -> Coalesce:
    """COUNT(*) of `rows` (filtered on the outer dispatcher) as a column of the outer query."""
    counted = rows.order_by().values("dispatcher").annotate(n=Count("*")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def dispatcher_sizes(using: str | None = None) -> dict[str, dict[str, int]]:
    """Per dispatcher: tasks in the pool, tasks in buckets, workers. One query: a row per
    dispatcher whose counts are subqueries over the claim index (dispatcher, state, ...),
    so done tasks, however many, are never read."""
    using = db.alias(using)

    def tasks(state: int) -> Coalesce:
        return _per_dispatcher(PoolTask.objects.using(using).filter(dispatcher=OuterRef("name"), state=state))

    rows = TaskPool.objects.using(using).order_by("name").values("name").annotate(
        pool=tasks(PoolTask.POOL),
        bucket=tasks(PoolTask.BUCKET),
        workers=_per_dispatcher(DispatchWorker.objects.using(using).filter(dispatcher=OuterRef("name"))),
    )
    return {row["name"]: {key: row[key] for key in ("pool", "bucket", "workers")} for row in rows}


def finished_per_bar(window: Window, now: datetime, using: str) -> dict[tuple[str, int], list[int]]:
    """(queue, status): jobs that succeeded, failed or died in each bar of `window`. One
    grouped query over the finished_at index (a closed range, which SQLite's planner
    takes; filtering on status too would send it to the claim index)."""
    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(now - window.span), stored(now)
    seconds = int(window.step.total_seconds())
    found: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0] * window.bars)
    with connection.cursor() as cursor:
        cursor.execute(sql.readings(connection).finished_per_bar, (start, seconds, start, end))
        for queue, status, bar, n in cursor.fetchall():
            if status in (Job.SUCCEEDED, Job.FAILED, Job.DEAD):
                found[queue, status][min(int(bar), window.bars - 1)] += n
    return found


def waiting_per_bar(window: Window, now: datetime, using: str) -> dict[str, list[int]]:
    """Per queue, the jobs waiting at the end of each bar of `window` (see the module's
    docstring). Each job in reach is reduced to the bar it entered and the bar it left,
    grouped in SQL, so the rows read back are at most (bars + 1)^2 per queue.

    Two branches of one statement, each on an index: unfinished jobs (claim index) and
    jobs that ended within the window (finished_at index, set only on finished jobs);
    nothing else waited in it.
    """
    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(now - window.span), stored(now)
    seconds = int(window.step.total_seconds())
    params = (start, start, seconds, window.bars, start, start, seconds)
    changes: dict[str, list[int]] = defaultdict(lambda: [0] * (window.bars + 1))
    with connection.cursor() as cursor:
        cursor.execute(sql.readings(connection).waits_per_bar, (*params, *params, start, end))
        for queue, entered, gone, n in cursor.fetchall():
            entered, gone = int(entered), min(int(gone), window.bars)
            if gone > entered:
                changes[queue][entered] += n
                changes[queue][gone] -= n
    depth = {}
    for queue, steps in changes.items():
        running, depth[queue] = 0, []
        for change in steps[:-1]:
            running += change
            depth[queue].append(running)
    return depth


# -- panels -----------------------------------------------------------------------------


def throughput(window: Window, found: dict[tuple[str, int], list[int]], now: datetime) -> Panel:
    """Succeeded under failed or dead, every queue together (failures per queue are below)."""
    ok, bad = [0] * window.bars, [0] * window.bars
    for (_, status), values in found.items():
        into = ok if status == Job.SUCCEEDED else bad
        for i, n in enumerate(values):
            into[i] += n
    label = (
        f"Jobs finished per {window.unit} over {window.name}: {sum(ok):,} succeeded,"
        f" {sum(bad):,} failed or dead"
    )
    series = [Series("succeeded", GREEN, ok), Series("failed or dead", RED, bad)]
    return Panel(f"Jobs finished per {window.unit}, {window.name}", columns(label, window, series, now))


def depth(window: Window, waiting: dict[str, list[int]], now: datetime) -> Panel:
    """Queues stacked, the busiest first; past the palette, the rest are summed."""
    order = sorted(waiting, key=lambda queue: (-max(waiting[queue]), queue))
    named = order[: len(QUEUE_COLOURS) - 1] if len(order) > len(QUEUE_COLOURS) else order
    series = [Series(queue, QUEUE_COLOURS[n], waiting[queue]) for n, queue in enumerate(named)]
    rest = order[len(named):]
    if rest:
        summed = [sum(waiting[queue][i] for queue in rest) for i in range(window.bars)]
        series.append(Series(f"{len(rest)} other queues", QUEUE_COLOURS[-1], summed))
    now_waiting = sum(s.values[-1] for s in series)
    label = f"Jobs waiting at the end of each {window.unit} over {window.name}; {now_waiting:,} now"
    return Panel(
        f"Jobs waiting, {window.name}", columns(label, window, series, now),
        "Rebuilt from the job rows still in the table: pruned jobs are missing.",
    )


def failures(day: dict[tuple[str, int], list[int]], hour: dict[tuple[str, int], list[int]]) -> Panel:
    """Failed and dead jobs per queue over the day, worst first, from the throughput
    readings (no query of its own); the note gives the rate and the last hour's count."""
    def per_queue(found: dict[tuple[str, int], list[int]]) -> dict[str, dict[int, int]]:
        totals: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for (queue, status), values in found.items():
            totals[queue][status] += sum(values)
        return totals

    days, hours = per_queue(day), per_queue(hour)

    def failed(queue: str, totals: dict[str, dict[int, int]]) -> tuple[int, int]:
        counts = totals.get(queue, {})
        return counts.get(Job.FAILED, 0) + counts.get(Job.DEAD, 0), sum(counts.values())

    rows = []
    for queue in sorted(days, key=lambda q: (-failed(q, days)[0], q)):
        bad, done = failed(queue, days)
        bad_hour, done_hour = failed(queue, hours)
        note = f"{bad:,} of {done:,} ({bad / done:.1%}); last hour {bad_hour:,} of {done_hour:,}"
        rows.append(Row(queue, [("failed", RED, days[queue].get(Job.FAILED, 0)),
                                ("dead", DARK_RED, days[queue].get(Job.DEAD, 0))], note))
    if not rows:
        return Panel("Failures per queue, the last day", nothing("No job finished in the last day."))
    label = f"Failed and dead jobs per queue over the last day, {len(rows)} queue(s)"
    return Panel("Failures per queue, the last day", rows_chart(label, rows, shares=False))


def dispatchers(using: str) -> Panel:
    """Tasks handed out (in buckets) beside tasks left (in the pool), on one scale."""
    rows = [
        Row(name, [("in buckets", ORANGE, sizes["bucket"]), ("in the pool", BLUE, sizes["pool"])],
            f"{sizes['pool']:,} in pool · {sizes['bucket']:,} in buckets · {sizes['workers']:,}"
            f" worker{'' if sizes['workers'] == 1 else 's'}")
        for name, sizes in dispatcher_sizes(using).items()
    ]
    if not rows:
        return Panel("Dispatchers", nothing("No dispatcher yet."))
    return Panel("Dispatchers", rows_chart(f"Tasks of {len(rows)} dispatcher(s)", rows, shares=False))


def job_panels(now: datetime, using: str) -> list[Panel]:
    """Jobs finished and waiting over the hour and the day, and failures per queue: four
    queries (the failures are counted from the finished jobs' readings)."""
    hour, day = finished_per_bar(HOUR, now, using), finished_per_bar(DAY, now, using)
    found = [throughput(HOUR, hour, now), throughput(DAY, day, now)]
    found += [depth(window, waiting_per_bar(window, now, using), now) for window in (HOUR, DAY)]
    found.append(failures(day, hour))
    return found


def dispatcher_panels(now: datetime, using: str) -> list[Panel]:
    """The dispatchers' panel: one query."""
    return [dispatchers(using)]


# -- metric families ----------------------------------------------------------------------


def job_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Jobs per queue and status, the queues' oldest due job and pause, and the outcomes
    and run times of the last hour: three queries."""
    from prometheus_client.core import GaugeMetricFamily

    backlog = job_backlog(now, using)
    outcomes = job_outcomes(now - WINDOW, now, using)
    counts: dict[tuple[str, str], int] = defaultdict(int, backlog.counts)
    durations: dict[tuple[str, str], list[Outcomes]] = defaultdict(list)
    for row in outcomes:
        counts[row.queue, row.status] += row.count
        durations[row.queue, row.name].append(row)
    queues = sorted(set(backlog.queues) | {queue for queue, _ in counts})

    jobs = GaugeMetricFamily(
        "leases_jobs",
        "Jobs per queue: ready, blocked and running now; succeeded, failed, dead and cancelled: finished"
        " in the last hour.",
        labels=["queue", "status"],
    )
    for queue in queues:
        for _, status in Job.STATUSES:
            jobs.add_metric([queue, status], counts[queue, status])
    yield jobs
    yield from _queue_metrics(now, backlog, queues)
    yield from _outcome_metrics(durations)


def _queue_metrics(now: datetime, backlog: Backlog, queues: list[str]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    due = GaugeMetricFamily(
        "leases_queue_oldest_due_age_seconds",
        "How long the queue's oldest due ready job has been due (0 when none is).",
        labels=["queue"],
    )
    paused = GaugeMetricFamily("leases_queue_paused", "1 while the queue is paused.", labels=["queue"])
    for queue in queues:
        oldest = backlog.oldest_due.get(queue)
        due.add_metric([queue], max((now - oldest).total_seconds(), 0.0) if oldest else 0.0)
        paused.add_metric([queue], int(backlog.queues.get(queue, False)))
    yield due
    yield paused


def _outcome_metrics(durations: dict[tuple[str, str], list[Outcomes]]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    finished = GaugeMetricFamily(
        "leases_job_outcomes", "Jobs finished in the last hour by queue, name and outcome.",
        labels=["queue", "name", "status"],
    )
    mean = GaugeMetricFamily(
        "leases_job_duration_mean_seconds",
        "Mean run time of the last attempt of jobs finished in the last hour.", labels=["queue", "name"],
    )
    longest = GaugeMetricFamily(
        "leases_job_duration_max_seconds",
        "Longest run time of the last attempt of jobs finished in the last hour.",
        labels=["queue", "name"],
    )
    for (queue, name), rows in sorted(durations.items()):
        for row in rows:
            finished.add_metric([queue, name, row.status], row.count)
        started = sum(row.started for row in rows)
        if started:
            mean.add_metric([queue, name], sum(row.seconds for row in rows) / started)
            longest.add_metric([queue, name], max(row.longest for row in rows))
    yield finished
    yield mean
    yield longest


def dispatcher_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Tasks in each dispatcher's pool and buckets, and its workers: one query."""
    from prometheus_client.core import GaugeMetricFamily

    tasks = GaugeMetricFamily(
        "leases_dispatcher_tasks", "Tasks of a dispatcher in its pool or in workers' buckets.",
        labels=["dispatcher", "state"],
    )
    workers = GaugeMetricFamily(
        "leases_dispatcher_workers", "Workers a dispatcher knows.", labels=["dispatcher"]
    )
    for name, sizes in dispatcher_sizes(using).items():
        tasks.add_metric([name, "pool"], sizes["pool"])
        tasks.add_metric([name, "bucket"], sizes["bucket"])
        workers.add_metric([name], sizes["workers"])
    yield tasks
    yield workers
