"""What the operators' dashboard and metrics read of the job queue and the dispatchers,
added to them by this app's ready() (see `leases.ops.readings`): the jobs' readings for
viewers who may view jobs, the dispatchers' for those who may view dispatchers.

What finished describes the operators' work, so internal jobs (an app's bookkeeping, a
pipeline's advance event: `registry.internal_names()`) are left out of it, by name in
the grouped query or in its grouped rows, never row by row. What waits is the queues'
load, internal jobs included.

Queue depth is reconstructed from the job rows, one grouped query per window: a job
waited at time t when ``enqueued_at <= t`` and it had not left by t, leaving when it
started (its last claim) or, if it never ran, when it ended. A bar shows the most jobs
that waited at once within it, so a backlog cleared in seconds still shows. It is an
approximation: only rows still in the table count, so pruned jobs (`leases_prune`, and
the runs beyond LEASES_KEEP_RUNS of a key) are missing; a job now waiting for a retry
counts as waiting since it was first enqueued; a job delayed into the future counts
from its push.
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
from django.utils.safestring import SafeString

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
    link_list,
    nothing,
    rows_chart,
)
from leases.ops.links import changelist
from leases.ops.readings import WINDOW, needs
from leases.sql import in_list

from . import registry, sql
from .jobs import counts, waits
from .models import DispatchWorker, Job, PoolTask, Queue, TaskPool

#: One colour per queue in the depth charts, busiest first; the last is for the rest.
QUEUE_COLOURS = ("#4a7fd0", "#9b59b6", "#17a2b8", "#d08700", "#8d6e63", "#7a7a7a")
#: Queues named under a throughput chart, the busiest; the rest are counted.
LISTED_QUEUES = 10
#: The admin's list the panels link to, and what a viewer needs to see them.
JOBS, VIEW_JOBS, VIEW_DISPATCHERS = "leases_tasks.job", "leases_tasks.view_job", "leases_tasks.view_taskpool"
#: (queue, status): jobs finished in each bar of a window.
Found = dict[tuple[str, int], list[int]]
#: Said wherever finished jobs are counted.
LEFT_OUT = "Internal jobs (an app's bookkeeping, such as a pipeline's advance events) are left out."


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
    """Jobs finished from `since` to `now` by queue, name and status, internal jobs left
    out of the grouped rows: one grouped query over the finished_at index. A job
    cancelled while waiting never ran: no run time.

    The range is closed on both sides so that SQLite's planner, with no statistics, picks
    the finished_at index instead of scanning the claim index for the GROUP BY's order."""
    took = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    names, internal = dict(Job.STATUSES), registry.internal_names()
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
        for row in rows if row["name"] not in internal
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


def finished_per_bar(window: Window, now: datetime, using: str) -> Found:
    """(queue, status): jobs that succeeded, failed or died in each bar of `window`, but
    internal ones. One grouped query over the finished_at index (a closed range, which
    SQLite's planner takes; filtering on status too would send it to the claim index)."""
    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(window.start(now)), stored(now)
    internal = sorted(registry.internal_names()) or [""]  # no job is named "": NOT IN ('') drops none
    statements = sql.readings(connection)
    found: Found = defaultdict(lambda: [0] * window.bars)
    with connection.cursor() as cursor:
        cursor.execute(statements.finished_per_bar + in_list(internal) + statements.finished_per_bar_tail,
                       (start, int(window.step.total_seconds()), start, end, *internal))
        for queue, status, bar, n in cursor.fetchall():
            if status in (Job.SUCCEEDED, Job.FAILED, Job.DEAD):
                found[queue, status][min(int(bar), window.bars - 1)] += n
    return found


@dataclass(frozen=True)
class Waiting:
    """A queue's jobs waiting over a window: the most at once within each bar, and now."""

    peaks: list[int]
    now: int


def waiting_per_bar(window: Window, now: datetime, using: str) -> dict[str, Waiting]:
    """Per queue, the most jobs waiting at once within each bar of `window` (see the
    module's docstring), from one statement that reads back a row per queue and bar: the
    peak within the bar, if anything moved in it, and the change over it. A bar where
    nothing moved peaks at what waited when it began."""
    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(window.start(now)), stored(now)
    params = (start, end, start, start, start, start, int(window.step.total_seconds()))
    moved: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
    with connection.cursor() as cursor:
        cursor.execute(sql.readings(connection).waiting_per_bar, params)
        for queue, bar, peak, change in cursor.fetchall():
            if int(bar) < window.bars:  # a job pushed since `now` was read
                moved[queue][int(bar)] = (int(peak), int(change))
    found = {}
    for queue, bars in moved.items():
        waiting, peaks = 0, []
        for bar in range(window.bars):
            peak, change = bars.get(bar, (waiting, 0))
            peaks.append(max(peak, waiting))
            waiting += change
        found[queue] = Waiting(peaks, waiting)
    return found


# -- panels -----------------------------------------------------------------------------


def _by_queue(found: Found, using: str) -> SafeString:
    """The busiest queues of a throughput chart, each a link to its jobs in the admin."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (queue, status), values in found.items():
        totals[queue][status != Job.SUCCEEDED] += sum(values)
    order = sorted(totals, key=lambda queue: (-sum(totals[queue]), queue))
    entries = [(f"{queue}: {totals[queue][0]:,} succeeded, {totals[queue][1]:,} failed or dead",
                changelist(JOBS, using, queue=queue)) for queue in order[:LISTED_QUEUES]]
    if len(order) > LISTED_QUEUES:
        entries.append((f"{len(order) - LISTED_QUEUES:,} more", ""))
    return link_list("By queue:", entries)


def throughput(window: Window, found: Found, now: datetime, using: str) -> Panel:
    """Succeeded under failed or dead, every queue together, then each queue's totals
    (failures per queue are below)."""
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
    chart = columns(label, window, series, now) + _by_queue(found, using)
    return Panel(f"Jobs finished per {window.unit}, {window.name}", chart, LEFT_OUT)


def depth(window: Window, waiting: dict[str, Waiting], now: datetime, using: str) -> Panel:
    """Queues stacked, the busiest first, each a link to its ready jobs; past the
    palette, the rest are summed."""
    order = sorted(waiting, key=lambda queue: (-max(waiting[queue].peaks), queue))
    named = order[: len(QUEUE_COLOURS) - 1] if len(order) > len(QUEUE_COLOURS) else order
    series = [Series(queue, QUEUE_COLOURS[n], waiting[queue].peaks,
                     changelist(JOBS, using, queue=queue, status__exact=Job.READY))
              for n, queue in enumerate(named)]
    rest = order[len(named):]
    if rest:
        summed = [sum(waiting[queue].peaks[i] for queue in rest) for i in range(window.bars)]
        series.append(Series(f"{len(rest)} other queues", QUEUE_COLOURS[-1], summed))
    now_waiting = sum(found.now for found in waiting.values())
    label = f"Peak of jobs waiting in each {window.unit} over {window.name}; {now_waiting:,} now"
    return Panel(
        f"Jobs waiting, {window.name}", columns(label, window, series, now),
        f"Each bar is the most jobs that waited at once in its {window.unit}. Rebuilt from the job rows"
        " still in the table: pruned jobs are missing.",
    )


#: The parts of a queue's bar in the failures panel, left to right: (name, colour, status).
OUTCOMES = (("failed", RED, Job.FAILED), ("dead", DARK_RED, Job.DEAD), ("succeeded", GREEN, Job.SUCCEEDED))


def _per_queue(found: Found) -> dict[str, dict[int, int]]:
    """Jobs finished over the whole window, per queue and status."""
    totals: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for (queue, status), values in found.items():
        totals[queue][status] += sum(values)
    return totals


def _failed(counts: dict[int, int]) -> tuple[int, int]:
    """Failed or dead, of all finished."""
    return counts.get(Job.FAILED, 0) + counts.get(Job.DEAD, 0), sum(counts.values())


def failures(day: Found, hour: Found, using: str) -> Panel:
    """Each queue's finished jobs over the day, the failed and dead as their parts of it,
    worst first, from the throughput readings (no query of its own); the note gives the
    rate and the last hour's count. A queue links to its jobs, a part to its status's."""
    days, hours = _per_queue(day), _per_queue(hour)
    rows = []
    for queue in sorted(days, key=lambda q: (-_failed(days[q])[0], q)):
        (bad, done), (bad_hour, done_hour) = _failed(days[queue]), _failed(hours.get(queue, {}))
        rows.append(Row(
            queue, [(name, colour, days[queue].get(status, 0)) for name, colour, status in OUTCOMES],
            f"{bad:,} of {done:,} ({bad / done:.1%}); last hour {bad_hour:,} of {done_hour:,}",
            changelist(JOBS, using, queue=queue),
            {name: changelist(JOBS, using, queue=queue, status__exact=code) for name, _, code in OUTCOMES},
        ))
    heading = "Failures per queue, the last day"
    if not rows:
        return Panel(heading, nothing("No job finished in the last day."))
    label = f"Failed and dead jobs as parts of each queue's finished jobs, last day, {len(rows)} queue(s)"
    note = f"A queue's bar is its jobs that succeeded, failed or died. {LEFT_OUT}"
    return Panel(heading, rows_chart(label, rows, shares=True), note)


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


@needs(VIEW_JOBS)
def job_panels(now: datetime, using: str) -> list[Panel]:
    """Jobs finished and waiting over the hour and the day, failures per queue, and jobs
    waiting for a resource per pool: five queries (the failures are counted from the
    finished jobs' readings), and one per pool whose jobs wait."""
    hour, day = finished_per_bar(HOUR, now, using), finished_per_bar(DAY, now, using)
    found = [throughput(HOUR, hour, now, using), throughput(DAY, day, now, using)]
    found += [depth(window, waiting_per_bar(window, now, using), now, using) for window in (HOUR, DAY)]
    found.append(failures(day, hour, using))
    found.append(waiting_for_resources(using))
    found.append(suspended_jobs(using))
    return found


def suspended_jobs(using: str) -> Panel:
    """Durable jobs suspended, per queue: sleeping, and waiting for an event (counts.suspended)."""
    rows = [Row(queue, [("sleeping", BLUE, n["sleeping"]), ("waiting for an event", ORANGE, n["waiting"])],
                f"{n['sleeping']:,} sleeping · {n['waiting']:,} waiting for an event")
            for queue, n in sorted(counts.suspended(using).items())]
    if not rows:
        return Panel("Durable jobs suspended", nothing("No durable job sleeps or waits for an event."))
    return Panel("Durable jobs suspended", rows_chart(f"Suspended jobs of {len(rows)} queue(s)", rows, shares=False))


def waiting_for_resources(using: str) -> Panel:
    """Jobs due and waiting for a resource, per pool and target, and why (jobs.waits)."""
    rows = [Row(f"{wait.pool} · {wait.target}" if wait.target else wait.pool, [("waiting", ORANGE, wait.due)],
                f"{wait.due:,} due · {wait.reason}")
            for wait in waits.waiting(using)]
    if not rows:
        return Panel("Jobs waiting for a resource", nothing("No job waits for a resource."))
    return Panel("Jobs waiting for a resource", rows_chart(f"Due jobs of {len(rows)} pool(s) and target(s)", rows,
                                                           shares=False))


@needs(VIEW_DISPATCHERS)
def dispatcher_panels(now: datetime, using: str) -> list[Panel]:
    """The dispatchers' panel: one query."""
    return [dispatchers(using)]


# -- metric families ----------------------------------------------------------------------


@needs(VIEW_JOBS)
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
        " in the last hour, internal jobs (an app's bookkeeping, such as a pipeline's advance events) left"
        " out.",
        labels=["queue", "status"],
    )
    for queue in queues:
        for _, status in Job.STATUSES:
            jobs.add_metric([queue, status], counts[queue, status])
    yield jobs
    yield from _queue_metrics(now, backlog, queues)
    yield from _outcome_metrics(durations)


@needs(VIEW_JOBS)
def resource_job_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Due jobs waiting for a resource, per pool."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("leases_jobs_waiting_for_resource",
                               "Due jobs that wait for a free resource of their pool.", labels=["pool"])
    for pool, due in sorted(waits.due_per_pool(using).items()):
        family.add_metric([pool], due)
    yield family


@needs(VIEW_JOBS)
def durable_job_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Durable jobs suspended per queue, sleeping or waiting for an event: one query."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily("leases_jobs_suspended",
                               "Durable jobs suspended, holding no worker: sleeping, or waiting for an event.",
                               labels=["queue", "kind"])
    for queue, n in sorted(counts.suspended(using).items()):
        family.add_metric([queue, "sleeping"], n["sleeping"])
        family.add_metric([queue, "event"], n["waiting"])
    yield family


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
        "leases_job_outcomes",
        "Jobs finished in the last hour by queue, name and outcome; internal jobs (an app's bookkeeping, such"
        " as a pipeline's advance events) are left out, here and in the run times.",
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


@needs(VIEW_DISPATCHERS)
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
