"""What the operators' dashboard and metrics read of pipeline runs, added to them by this
app's ready() (see `leases.ops.readings`) for viewers who may view runs."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db.models import Count

from leases import db
from leases.ops.charts import BLUE, DAY, GREEN, GREY, ORANGE, RED, Panel, Row, count, nothing, rows_chart
from leases.ops.links import changelist
from leases.ops.readings import WINDOW, needs

from .models import Run

#: A pipeline's bar shows its runs' statuses in this order, in the admin's colours.
RUN_COLOURS = {"running": ORANGE, "paused": BLUE, "succeeded": GREEN, "failed": RED, "cancelled": GREY}
#: The admin's list the panel links to, and what a viewer needs to see the runs.
RUNS, VIEW = "leases_pipelines.run", "leases_pipelines.view_run"


def pipeline_runs(since: datetime, now: datetime, using: str | None = None) -> dict[tuple[str, str], int]:
    """(pipeline, status): live runs now, through the (status, pipeline) index, and runs
    that ended from `since` to `now`, through the finished_at index. Two queries."""
    runs = Run.objects.using(db.alias(using)).order_by()
    found: dict[tuple[str, str], int] = {}
    for rows in (runs.filter(status__in=Run.LIVE), runs.filter(finished_at__range=(since, now))):
        for row in rows.values("pipeline", "status").annotate(n=Count("*")):
            found[row["pipeline"], row["status"]] = row["n"]
    return found


def runs(now: datetime, using: str) -> Panel:
    """Per pipeline: live runs, and runs that ended in the last day (older ones would
    grow with the history), by status. A pipeline links to its runs in the admin, a
    status to its runs of that status."""
    found = pipeline_runs(now - DAY.span, now, using)
    by_pipeline: dict[str, dict[str, int]] = defaultdict(dict)
    for (pipeline, status), n in found.items():
        by_pipeline[pipeline][status] = n
    rows = []
    for pipeline, counts in sorted(by_pipeline.items()):
        segments = [(status, colour, counts.get(status, 0)) for status, colour in RUN_COLOURS.items()]
        rows.append(Row(
            pipeline, segments, " · ".join(count(v, name) for name, _, v in segments if v),
            changelist(RUNS, using, pipeline=pipeline),
            {name: changelist(RUNS, using, pipeline=pipeline, status__exact=name) for name in RUN_COLOURS},
        ))
    heading = "Pipeline runs: live, and ended in the last day"
    if not rows:
        return Panel(heading, nothing("No live pipeline run, and none ended in the last day."))
    label = f"Pipeline runs of {len(rows)} pipeline(s) by status"
    return Panel(heading, rows_chart(label, rows, shares=False))


@needs(VIEW)
def run_panels(now: datetime, using: str) -> list[Panel]:
    """The pipeline runs' panel: two queries."""
    return [runs(now, using)]


@needs(VIEW)
def run_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Live runs and runs ended in the last hour, per pipeline and status: two queries."""
    from prometheus_client.core import GaugeMetricFamily

    found = GaugeMetricFamily(
        "leases_pipeline_runs",
        "Pipeline runs: running and paused now; succeeded, failed and cancelled in the last hour.",
        labels=["pipeline", "status"],
    )
    for (pipeline, status), n in sorted(pipeline_runs(now - WINDOW, now, using).items()):
        found.add_metric([pipeline, status], n)
    yield found
