"""Prometheus metrics of the engine, read from the database when Prometheus scrapes.

Every figure is computed from the tables at scrape time by a custom collector, so any
number of web and worker processes expose the same numbers with no shared state and
nothing to keep in step. Each reading is one grouped query through an existing index
(or a small table), a fixed number per scrape however many rows the tables hold, and
every time is judged by the database clock, read once per scrape.

The readings (`resources_by_pool`, `job_backlog`, ...) are plain Django and also feed
the dashboard; only the collector and the view need `prometheus_client`, the optional
extra ``django-leases[metrics]``.
"""
from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
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
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import db, routing
from .models import Lock, Resource
from .pool import db_now

#: Finished jobs and runs are counted over this window (a gauge, not a counter: rows are
#: pruned, so a lifetime total could not be read back from the tables).
WINDOW = timedelta(hours=1)
MISSING = "prometheus_client is not installed: pip install django-leases[metrics]\n"


# -- readings ---------------------------------------------------------------------------


def resources_by_pool(now: datetime, using: str | None = None) -> dict[str, dict[str, int]]:
    """Per pool: slots by state (as Pool.stats judges them) and `tokens`, the sum of its
    fencing tokens. One grouped query that reads every slot row: pools hold thousands of
    slots, not the millions of rows the job and task tables may."""
    busy = Q(busy_before__gt=now)
    quarantined = Q(quarantined_until__gt=now)
    rows = (
        Resource.objects.using(db.alias(using)).order_by("pool").values("pool").annotate(
            total=Count("*"),
            quarantined=Count("pk", filter=quarantined),
            held=Count("pk", filter=busy & ~Q(holder="") & ~quarantined),
            cooling=Count("pk", filter=busy & Q(holder="") & ~quarantined),
            tokens=Sum("token"),
        )
    )
    return {
        row["pool"]: {
            Resource.FREE: row["total"] - row["held"] - row["cooling"] - row["quarantined"],
            Resource.HELD: row["held"],
            Resource.COOLING: row["cooling"],
            Resource.QUARANTINED: row["quarantined"],
            "tokens": int(row["tokens"] or 0),
        }
        for row in rows
    }


def locks_held(now: datetime, using: str | None = None) -> int:
    """One count over the lock table, a row per lock name ever used."""
    return Lock.objects.using(db.alias(using)).filter(expires_at__gt=now).count()


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
    from leases.tasks.models import Job, Queue

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
    from leases.tasks.models import Job

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
    from leases.tasks.models import DispatchWorker, PoolTask, TaskPool

    using = db.alias(using)

    def tasks(state: int) -> Coalesce:
        return _per_dispatcher(PoolTask.objects.using(using).filter(dispatcher=OuterRef("name"), state=state))

    rows = TaskPool.objects.using(using).order_by("name").values("name").annotate(
        pool=tasks(PoolTask.POOL),
        bucket=tasks(PoolTask.BUCKET),
        workers=_per_dispatcher(DispatchWorker.objects.using(using).filter(dispatcher=OuterRef("name"))),
    )
    return {row["name"]: {key: row[key] for key in ("pool", "bucket", "workers")} for row in rows}


def pipeline_runs(since: datetime, now: datetime, using: str | None = None) -> dict[tuple[str, str], int]:
    """(pipeline, status): live runs now, through the (status, pipeline) index, and runs
    that ended from `since` to `now`, through the finished_at index. Two queries."""
    from leases.pipelines.models import Run

    runs = Run.objects.using(db.alias(using)).order_by()
    found: dict[tuple[str, str], int] = {}
    for rows in (runs.filter(status__in=Run.LIVE), runs.filter(finished_at__range=(since, now))):
        for row in rows.values("pipeline", "status").annotate(n=Count("*")):
            found[row["pipeline"], row["status"]] = row["n"]
    return found


# -- the collector ----------------------------------------------------------------------


class LeasesCollector:
    """A prometheus_client collector that reads the engine's tables at each collect().

    Registering it elsewhere (``REGISTRY.register(LeasesCollector())``) reads nothing:
    describe() names no metric, so the registry does not collect at registration.
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        using = db.alias(self.using)
        now = db_now(using)
        resources = GaugeMetricFamily(
            "leases_resources", "Resource slots per pool by state, by the database clock.",
            labels=["pool", "state"],
        )
        acquisitions = CounterMetricFamily(
            "leases_lease_acquisitions",
            "Sum of the pool's fencing tokens: leases acquired, plus evictions and quarantines, which"
            " bump the token too. It drops when resources are removed.",
            labels=["pool"],
        )
        for pool, counts in resources_by_pool(now, using).items():
            for state in Resource.STATES:
                resources.add_metric([pool, state], counts[state])
            acquisitions.add_metric([pool], counts["tokens"])
        yield resources
        yield acquisitions
        yield GaugeMetricFamily("leases_locks_held", "Named locks held now.", value=locks_held(now, using))
        if apps.is_installed("leases.tasks"):
            yield from self._jobs(now, using)
            yield from self._dispatchers(using)
        if apps.is_installed("leases.pipelines"):
            runs = GaugeMetricFamily(
                "leases_pipeline_runs",
                "Pipeline runs: running and paused now; succeeded, failed and cancelled in the last hour.",
                labels=["pipeline", "status"],
            )
            for (pipeline, status), n in sorted(pipeline_runs(now - WINDOW, now, using).items()):
                runs.add_metric([pipeline, status], n)
            yield runs

    def _jobs(self, now: datetime, using: str) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        from leases.tasks.models import Job

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

    def _dispatchers(self, using: str) -> Iterator[Any]:
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


# -- the view ---------------------------------------------------------------------------


def allowed(request: HttpRequest) -> bool:
    """A bearer token equal to settings.LEASES_METRICS_TOKEN (compared in constant time),
    or a logged-in staff user. The token is checked first: a scrape has no session."""
    token = getattr(settings, "LEASES_METRICS_TOKEN", "") or ""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The Prometheus text format; 403 without access, 501 without prometheus_client.
    `?database=ALIAS` reads another database in use than LEASES_DATABASE (one scrape
    target per database)."""
    if not allowed(request):
        return HttpResponse("Staff only, or a bearer token.\n", status=403, content_type="text/plain")
    try:
        using = routing.known(request.GET.get("database") or db.alias())
    except ValueError as exc:
        return HttpResponse(f"{exc}\n", status=400, content_type="text/plain")
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError:
        return HttpResponse(MISSING, status=501, content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LeasesCollector(using))
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
