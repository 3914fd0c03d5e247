"""The operator dashboard: one page of charts, drawn as inline SVG on the server.

Staff only (others are sent to the admin's login). No JavaScript and no build step: each
chart is an SVG with a title, an aria-label and a tooltip per bar, and the page extends
the admin's base template so it sits beside the admin, dark mode included (text and
grid lines are drawn in currentColor). Like the metrics, it costs a fixed number of
grouped queries however large the tables are, with every time judged by the database
clock, read once per page.

Queue depth is reconstructed from the job rows, one grouped query per window: a job
waited at time t when ``enqueued_at <= t`` and it had not left by t, leaving when it
started (its last claim) or, if it never ran, when it ended. It is an approximation:
only rows still in the table count, so pruned jobs (`leases_prune`, and the runs beyond
LEASES_KEEP_RUNS of a key) are missing; a job now waiting for a retry counts as waiting
since it was first enqueued; a job delayed into the future counts from its push.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.apps import apps
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.cache import never_cache

from . import db, routing
from .metrics import dispatcher_sizes, pipeline_runs, resources_by_pool
from .models import Resource
from .pool import db_now

#: Colours of states, as the admin shows them; a pool's bar shows its states in this order.
GREEN, ORANGE, BLUE, RED, DARK_RED, GREY = "#2e9c4a", "#d08700", "#4a7fd0", "#d3372c", "#8c1d16", "#7a7a7a"
STATE_COLOURS = {
    Resource.HELD: ORANGE, Resource.COOLING: BLUE, Resource.QUARANTINED: RED, Resource.FREE: GREEN,
}
RUN_COLOURS = {"running": ORANGE, "paused": BLUE, "succeeded": GREEN, "failed": RED, "cancelled": GREY}
#: One colour per queue in the depth charts, busiest first; the last is for the rest.
QUEUE_COLOURS = ("#4a7fd0", "#9b59b6", "#17a2b8", "#d08700", "#8d6e63", "#7a7a7a")
#: Geometry, in pixels, sized for two charts side by side beside the admin's sidebar at
#: 1400 pixels: column charts plot PLOT_W x PLOT_H inside margins; row charts are WIDTH
#: wide, each row ROW_H high: a line of label and note, then the bar.
PLOT_W, PLOT_H, LEFT, RIGHT, TOP, BOTTOM = 424, 150, 40, 16, 10, 22
WIDTH, ROW_H, BAR_H = 480, 36, 12
#: Rows a chart shows at most; the rest are counted in a last line.
MAX_ROWS = 30

#: Whole steps of %s seconds from the window's start (%s) to a column, per vendor. Only
#: columns at or after the start are passed, so truncating toward zero is the floor.
_STEPS = {
    "sqlite": "CAST((julianday({col}) - julianday(%s)) * 86400 / %s AS INTEGER)",
    "mysql": "FLOOR(TIMESTAMPDIFF(MICROSECOND, %s, {col}) / (%s * 1000000))",
}


@dataclass(frozen=True)
class Window:
    """A time axis: `bars` steps of one `unit` ending at the page's now, a label every
    `every` bars."""

    name: str
    step: timedelta
    bars: int
    every: int
    unit: str
    short: str
    clock: str  # strftime of a column's times in its tooltip

    @property
    def span(self) -> timedelta:
        return self.step * self.bars


HOUR = Window("the last hour", timedelta(minutes=1), 60, 15, "minute", "m", "%H:%M")
DAY = Window("the last day", timedelta(hours=1), 24, 6, "hour", "h", "%a %H:%M")


@dataclass(frozen=True)
class Series:
    name: str
    colour: str
    values: list[int]


@dataclass(frozen=True)
class Row:
    """One bar of a row chart: (name, colour, value) segments, left to right."""

    label: str
    segments: list[tuple[str, str, int]]
    note: str


@dataclass(frozen=True)
class Panel:
    heading: str
    chart: SafeString
    note: str = ""


# -- readings ---------------------------------------------------------------------------


def _steps(vendor: str, column: str) -> str:
    return _STEPS[vendor].format(col=column)


def finished_per_bar(window: Window, now: datetime, using: str) -> dict[tuple[str, int], list[int]]:
    """(queue, status): jobs that succeeded, failed or died in each bar of `window`. One
    grouped query over the finished_at index (a closed range, which SQLite's planner
    takes; filtering on status too would send it to the claim index)."""
    from leases.tasks.models import Job

    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(now - window.span), stored(now)
    seconds = int(window.step.total_seconds())
    sql = (
        f"SELECT queue, status, {_steps(connection.vendor, 'finished_at')} AS bar, COUNT(*)"
        f" FROM {db.table(Job, connection)} WHERE finished_at BETWEEN %s AND %s GROUP BY queue, status, bar"
    )
    found: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0] * window.bars)
    with connection.cursor() as cursor:
        cursor.execute(sql, (start, seconds, start, end))
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
    from leases.tasks.models import Job

    connection = connections[using]
    stored = db.dialect(connection).stored_datetime
    start, end = stored(now - window.span), stored(now)
    seconds = int(window.step.total_seconds())
    left = "COALESCE(started_at, finished_at)"
    columns = (
        f"SELECT queue, CASE WHEN enqueued_at < %s THEN 0 ELSE {_steps(connection.vendor, 'enqueued_at')} END"
        f" AS entered, CASE WHEN status IN (%s, %s) THEN %s WHEN {left} < %s THEN 0"
        f" ELSE {_steps(connection.vendor, left)} END AS gone FROM {db.table(Job, connection)}"
    )
    params = (start, start, seconds, Job.READY, Job.BLOCKED, window.bars, start, start, seconds)
    sql = (
        f"SELECT queue, entered, gone, COUNT(*) FROM ({columns} WHERE status IN (%s, %s, %s)"
        f" UNION ALL {columns} WHERE finished_at BETWEEN %s AND %s) AS waits"
        " GROUP BY queue, entered, gone"
    )
    unfinished = (Job.READY, Job.BLOCKED, Job.RUNNING)
    changes: dict[str, list[int]] = defaultdict(lambda: [0] * (window.bars + 1))
    with connection.cursor() as cursor:
        cursor.execute(sql, (*params, *unfinished, *params, start, end))
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


# -- charts -----------------------------------------------------------------------------


def _px(value: float) -> str:
    return f"{value:.1f}"


def _scale(peak: int) -> tuple[int, int]:
    """A round top for the y axis and its grid step: at most five steps of 1, 2 or 5 x 10^k."""
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            step = mantissa * 10**exponent
            if peak <= 5 * step:
                return max(step * math.ceil(peak / step), step), step
        exponent += 1


def _svg(width: float, height: float, label: str) -> SafeString:
    """The opening of a chart: an image to assistive technology, named twice (aria-label
    for screen readers, <title> for a tooltip), scaled down to fit a narrow column."""
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="leases-chart" viewBox="0 0 {0} {1}" width="{0}"'
        ' height="{1}" role="img" aria-label="{2}" style="font: 11px sans-serif; max-width: 100%;'
        ' height: auto"><title>{2}</title>',
        width, height, label,
    )


def _legend(entries: Iterable[tuple[str, str]]) -> SafeString:
    return format_html(
        '<p class="help leases-legend">{}</p>',
        format_html_join(
            " ", '<span style="white-space: nowrap"><span style="color: {}">■</span> {}</span>', entries
        ),
    )


def columns(label: str, window: Window, series: list[Series], now: datetime) -> SafeString:
    """Stacked columns, one per bar of `window` (oldest left), on a round y axis; each
    column's tooltip gives its time and values."""
    totals = [sum(s.values[i] for s in series) for i in range(window.bars)]
    top, step = _scale(max(totals, default=0))
    slot = PLOT_W / window.bars
    base = TOP + PLOT_H
    parts = [_svg(LEFT + PLOT_W + RIGHT, TOP + PLOT_H + BOTTOM, label)]
    for mark in range(0, top + 1, step):
        y = _px(base - PLOT_H * mark / top)
        parts.append(format_html(
            '<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="currentColor" stroke-opacity="0.15"/>'
            '<text x="{3}" y="{1}" dy="4" text-anchor="end" fill="currentColor">{4}</text>',
            LEFT, y, LEFT + PLOT_W, LEFT - 6, f"{mark:,}",
        ))
    origin = now - window.span
    for i in range(window.bars):
        x = LEFT + i * slot
        begins = timezone.localtime(origin + i * window.step)
        ends = timezone.localtime(origin + (i + 1) * window.step)
        values = ", ".join(f"{s.values[i]:,} {s.name}" for s in series if s.values[i]) or "none"
        parts.append(format_html(
            '<g><title>{} to {}: {}</title><rect x="{}" y="{}" width="{}" height="{}" fill="transparent"/>',
            begins.strftime(window.clock), ends.strftime("%H:%M"), values, _px(x), TOP, _px(slot), PLOT_H,
        ))
        stacked = 0
        for s in series:
            if s.values[i]:
                height = PLOT_H * s.values[i] / top
                stacked += height
                parts.append(format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"/>',
                    _px(x + 0.5), _px(base - stacked), _px(max(slot - 1, 1)), _px(height), s.colour,
                ))
        parts.append(mark_safe("</g>"))
    for i in range(0, window.bars + 1, window.every):
        ago = window.bars - i
        parts.append(format_html(
            '<text x="{}" y="{}" text-anchor="middle" fill="currentColor">{}</text>',
            _px(LEFT + i * slot), base + 16, f"-{ago}{window.short}" if ago else "now",
        ))
    parts.append(mark_safe("</svg>"))
    return format_html(
        '<div class="leases-figure">{}</div>{}',
        mark_safe("".join(parts)),  # safe: each part was built by format_html
        _legend((s.colour, s.name) for s in series),
    )


def rows_chart(label: str, rows: list[Row], shares: bool) -> SafeString:
    """Horizontal stacked bars, one per row under its label and note. `shares`: each bar
    is its row's total (parts of a whole); otherwise all bars share one scale."""
    shown = rows[:MAX_ROWS]
    peak = max((sum(v for _, _, v in row.segments) for row in shown), default=0)
    extra = len(rows) > MAX_ROWS
    parts = [_svg(WIDTH, ROW_H * (len(shown) + extra), label)]
    for n, row in enumerate(shown):
        y = n * ROW_H
        total = sum(v for _, _, v in row.segments)
        scale = (WIDTH / total if total else 0.0) if shares else (WIDTH / peak if peak else 0.0)
        parts.append(format_html(
            '<g><title>{}: {}</title><text x="0" y="{}" font-weight="bold" fill="currentColor">{}</text>'
            '<text x="{}" y="{}" text-anchor="end" fill="currentColor">{}</text>'
            '<rect x="0" y="{}" width="{}" height="{}" fill="currentColor" fill-opacity="0.08"/>',
            row.label, row.note, y + 12, row.label if len(row.label) <= 30 else row.label[:29] + "…",
            WIDTH, y + 12, row.note, y + 17, WIDTH, BAR_H,
        ))
        x = 0.0
        for name, colour, value in row.segments:
            if value:
                parts.append(format_html(
                    '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}: {} {}</title></rect>',
                    _px(x), y + 17, _px(value * scale), BAR_H, colour, row.label, f"{value:,}", name,
                ))
                x += value * scale
        parts.append(mark_safe("</g>"))
    if extra:
        parts.append(format_html(
            '<text x="0" y="{}" fill="currentColor">… and {} more</text>',
            len(shown) * ROW_H + 12, f"{len(rows) - len(shown):,}",
        ))
    parts.append(mark_safe("</svg>"))
    legend = {(colour, name): None for row in shown for name, colour, _ in row.segments}
    return format_html(
        '<div class="leases-figure">{}</div>{}',
        mark_safe("".join(parts)),  # safe: each part was built by format_html
        _legend(legend),
    )


# -- panels -----------------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}"


def throughput(window: Window, found: dict[tuple[str, int], list[int]], now: datetime) -> Panel:
    """Succeeded under failed or dead, every queue together (failures per queue are below)."""
    from leases.tasks.models import Job

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
    from leases.tasks.models import Job

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
        return Panel("Failures per queue, the last day", _nothing("No job finished in the last day."))
    label = f"Failed and dead jobs per queue over the last day, {len(rows)} queue(s)"
    return Panel("Failures per queue, the last day", rows_chart(label, rows, shares=False))


def pools(now: datetime, using: str) -> Panel:
    """Each pool's slots as shares of the pool: pools of 5 and 5,000 read alike."""
    rows = []
    for pool, counts in resources_by_pool(now, using).items():
        segments = [(state, colour, counts[state]) for state, colour in STATE_COLOURS.items()]
        note = " · ".join(_count(n, state) for state, _, n in segments if n)
        rows.append(Row(pool, segments, f"{note} of {sum(n for _, _, n in segments):,}"))
    if not rows:
        return Panel("Resource pools", _nothing("No resources yet."))
    return Panel("Resource pools", rows_chart(f"Slots of {len(rows)} pool(s) by state", rows, shares=True))


def dispatchers(using: str) -> Panel:
    """Tasks handed out (in buckets) beside tasks left (in the pool), on one scale."""
    rows = [
        Row(name, [("in buckets", ORANGE, sizes["bucket"]), ("in the pool", BLUE, sizes["pool"])],
            f"{sizes['pool']:,} in pool · {sizes['bucket']:,} in buckets · {sizes['workers']:,}"
            f" worker{'' if sizes['workers'] == 1 else 's'}")
        for name, sizes in dispatcher_sizes(using).items()
    ]
    if not rows:
        return Panel("Dispatchers", _nothing("No dispatcher yet."))
    return Panel("Dispatchers", rows_chart(f"Tasks of {len(rows)} dispatcher(s)", rows, shares=False))


def runs(now: datetime, using: str) -> Panel:
    """Per pipeline: live runs, and runs that ended in the last day (older ones would
    grow with the history), by status."""
    found = pipeline_runs(now - DAY.span, now, using)
    by_pipeline: dict[str, dict[str, int]] = defaultdict(dict)
    for (pipeline, status), n in found.items():
        by_pipeline[pipeline][status] = n
    rows = []
    for pipeline, counts in sorted(by_pipeline.items()):
        segments = [(status, colour, counts.get(status, 0)) for status, colour in RUN_COLOURS.items()]
        rows.append(Row(pipeline, segments, " · ".join(_count(v, name) for name, _, v in segments if v)))
    heading = "Pipeline runs: live, and ended in the last day"
    if not rows:
        return Panel(heading, _nothing("No live pipeline run, and none ended in the last day."))
    label = f"Pipeline runs of {len(rows)} pipeline(s) by status"
    return Panel(heading, rows_chart(label, rows, shares=False))


def _nothing(text: str) -> SafeString:
    return format_html('<p class="leases-empty">{}</p>', text)


def panels(now: datetime, using: str) -> list[Panel]:
    """Every chart of the page, from eight queries: four for the jobs, one for the pools,
    one for the dispatchers, two for the pipeline runs."""
    found: list[Panel] = []
    if apps.is_installed("leases.tasks"):
        hour, day = finished_per_bar(HOUR, now, using), finished_per_bar(DAY, now, using)
        found += [throughput(HOUR, hour, now), throughput(DAY, day, now)]
        found += [depth(window, waiting_per_bar(window, now, using), now) for window in (HOUR, DAY)]
        found.append(failures(day, hour))
    found.append(pools(now, using))
    if apps.is_installed("leases.tasks"):
        found.append(dispatchers(using))
    if apps.is_installed("leases.pipelines"):
        found.append(runs(now, using))
    return found


@never_cache
@staff_member_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The page, in the admin's frame (its header, sidebar and theme); `?database=ALIAS`
    shows another database in use than LEASES_DATABASE."""
    try:
        using = routing.known(request.GET.get("database") or db.alias())
    except ValueError as exc:
        return HttpResponseBadRequest(f"{exc}\n", content_type="text/plain")
    now = db_now(using)
    title = "Leases dashboard" + ("" if using == db.alias() else f" of database {using}")
    context = {**admin.site.each_context(request), "title": title, "now": now,
               "panels": panels(now, using)}
    return render(request, "leases/dashboard.html", context)
