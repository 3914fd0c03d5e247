"""The dashboard's charts, drawn as inline SVG on the server: no script draws them.

Each chart is an SVG with a title, an aria-label and a tooltip per bar, its text and grid
lines drawn in currentColor so that it follows the admin's theme, dark mode included.
Every app's panels are drawn with these: stacked columns over a time window, and rows of
stacked bars. A row, a segment or a legend entry may link to the admin's rows it counts.

A time window's bars are whole minutes (or hours) of the local clock, the last one the
unit now runs in: a bar's tooltip names exactly the span it counts, and says when that
span is still running.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import slugify

#: Colours of states, as the admin shows them.
GREEN, ORANGE, BLUE, RED, DARK_RED, GREY = "#2e9c4a", "#d08700", "#4a7fd0", "#d3372c", "#8c1d16", "#7a7a7a"
#: Geometry, in pixels, sized for two charts side by side beside the admin's sidebar at
#: 1400 pixels: column charts plot PLOT_W x PLOT_H inside margins; row charts are WIDTH
#: wide, each row ROW_H high: a line of label and note, then the bar.
PLOT_W, PLOT_H, LEFT, RIGHT, TOP, BOTTOM = 424, 150, 40, 16, 10, 22
WIDTH, ROW_H, BAR_H = 480, 36, 12
#: Rows a chart shows at most; the rest are counted in a last line.
MAX_ROWS = 30


@dataclass(frozen=True)
class Window:
    """A time axis: `bars` whole steps of one `unit` of the local clock, the last one the
    step the page's now falls in (so it is partial); a clock label on the steps that are
    a multiple of `every` steps since midnight."""

    name: str
    step: timedelta
    bars: int
    every: int
    unit: str
    clock: str  # strftime of a column's start in its tooltip

    @property
    def span(self) -> timedelta:
        return self.step * self.bars

    def _since_midnight(self, moment: datetime) -> timedelta:
        """Wall-clock time since the local midnight (same tzinfo: Python subtracts the
        wall clocks, so a change to summer time does not shift the steps)."""
        local = timezone.localtime(moment)
        return local - local.replace(hour=0, minute=0, second=0, microsecond=0)

    def start(self, now: datetime) -> datetime:
        """The beginning of the first bar, in UTC: the beginning of the step `now` falls
        in, less bars - 1 steps of real time."""
        began = timezone.localtime(now) - self._since_midnight(now) % self.step
        return began.astimezone(UTC) - self.step * (self.bars - 1)

    def marked(self, moment: datetime) -> bool:
        """Whether the axis labels this boundary of a bar (15-minute or 6-hour marks)."""
        return self._since_midnight(moment) // self.step % self.every == 0


HOUR = Window("the last hour", timedelta(minutes=1), 60, 15, "minute", "%H:%M")
DAY = Window("the last day", timedelta(hours=1), 24, 6, "hour", "%a %H:%M")


@dataclass(frozen=True)
class Series:
    """One colour of a column chart; `link`, the admin's rows it counts (on its legend)."""

    name: str
    colour: str
    values: list[int]
    link: str = ""


@dataclass(frozen=True)
class Row:
    """One bar of a row chart: (name, colour, value) segments, left to right. `link` is
    the admin's list of the row's rows (on its label), `links` those of a segment, by name."""

    label: str
    segments: list[tuple[str, str, int]]
    note: str
    link: str = ""
    links: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Panel:
    heading: str
    chart: SafeString
    note: str = ""

    @property
    def key(self) -> str:
        """The panel's id on the page, which a refresh swaps by: its heading, slugified."""
        return slugify(self.heading)


def count(n: int, what: str) -> str:
    return f"{n:,} {what}"


def nothing(text: str) -> SafeString:
    """What a panel shows instead of a chart when there is nothing to draw."""
    return format_html('<p class="leases-empty">{}</p>', text)


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


def linked(link: str, inner: SafeString) -> SafeString:
    """`inner` as a link to `link` (SVG 2 and HTML alike), or as it is without one."""
    return format_html('<a href="{}">{}</a>', link, inner) if link else inner


def _legend(entries: Iterable[tuple[str, str, str]]) -> SafeString:
    """(colour, name, link) entries; a named entry links to its rows where it has a link."""
    return format_html(
        '<p class="help leases-legend">{}</p>',
        format_html_join(
            " ", '<span style="white-space: nowrap"><span style="color: {}">■</span> {}</span>',
            ((colour, linked(link, format_html("{}", name))) for colour, name, link in entries),
        ),
    )


def link_list(lead: str, entries: Iterable[tuple[str, str]]) -> SafeString:
    """A line under a chart: `lead`, then (text, link) entries, each a link where it has one."""
    items = [(linked(link, format_html("{}", text)),) for text, link in entries]
    if not items:
        return mark_safe("")
    return format_html('<p class="help leases-links">{} {}</p>', lead, format_html_join(" · ", "{}", items))


def _tooltip(window: Window, begins: datetime, now: datetime, values: str) -> SafeString:
    """A column's span and values; the span `now` falls in says it is running."""
    ends = begins + window.step
    local = timezone.localtime
    so_far = f", so far (to {local(now):%H:%M:%S})" if ends > now else ""
    return format_html(
        "{} to {}{}: {}", local(begins).strftime(window.clock), local(ends).strftime("%H:%M"), so_far, values
    )


def _axis(window: Window, origin: datetime, slot: float, base: float) -> list[SafeString]:
    """Clock labels under the bars' boundaries that fall on the window's marks."""
    marks = []
    for i in range(window.bars + 1):
        moment = origin + i * window.step
        if window.marked(moment):
            marks.append(format_html(
                '<text x="{}" y="{}" text-anchor="middle" fill="currentColor">{}</text>',
                _px(LEFT + i * slot), base + 16, timezone.localtime(moment).strftime("%H:%M"),
            ))
    return marks


def columns(label: str, window: Window, series: list[Series], now: datetime) -> SafeString:
    """Stacked columns, one per bar of `window` (oldest left), on a round y axis; each
    column's tooltip gives its span and values."""
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
    origin = window.start(now)
    for i in range(window.bars):
        x = LEFT + i * slot
        values = ", ".join(f"{s.values[i]:,} {s.name}" for s in series if s.values[i]) or "none"
        parts.append(format_html(
            '<g><title>{}</title><rect x="{}" y="{}" width="{}" height="{}" fill="transparent"/>',
            _tooltip(window, origin + i * window.step, now, values), _px(x), TOP, _px(slot), PLOT_H,
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
    parts += _axis(window, origin, slot, base)
    parts.append(mark_safe("</svg>"))
    return format_html(
        '<div class="leases-figure">{}</div>{}',
        mark_safe("".join(parts)),  # safe: each part was built by format_html
        _legend((s.colour, s.name, s.link) for s in series),
    )


def _row(row: Row, y: int, scale: float) -> SafeString:
    """One row: its label (a link to its rows, if any), note, track and segments (each a
    link to its own rows, if any)."""
    name = format_html(
        '<text x="0" y="{}" font-weight="bold" fill="currentColor">{}</text>',
        y + 12, row.label if len(row.label) <= 30 else row.label[:29] + "…",
    )
    parts = [format_html(
        '<g><title>{}: {}</title>{}<text x="{}" y="{}" text-anchor="end" fill="currentColor">{}</text>'
        '<rect x="0" y="{}" width="{}" height="{}" fill="currentColor" fill-opacity="0.08"/>',
        row.label, row.note,
        linked(row.link, name),
        WIDTH, y + 12, row.note, y + 17, WIDTH, BAR_H,
    )]
    x = 0.0
    for segment, colour, value in row.segments:
        if value:
            parts.append(linked(row.links.get(segment, ""), format_html(
                '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}: {} {}</title></rect>',
                _px(x), y + 17, _px(value * scale), BAR_H, colour, row.label, f"{value:,}", segment,
            )))
            x += value * scale
    parts.append(mark_safe("</g>"))
    return mark_safe("".join(parts))  # safe: each part was built by format_html


def rows_chart(label: str, rows: list[Row], shares: bool) -> SafeString:
    """Horizontal stacked bars, one per row under its label and note. `shares`: each bar
    is its row's total (parts of a whole); otherwise all bars share one scale."""
    shown = rows[:MAX_ROWS]
    peak = max((sum(v for _, _, v in row.segments) for row in shown), default=0)
    extra = len(rows) > MAX_ROWS
    parts = [_svg(WIDTH, ROW_H * (len(shown) + extra), label)]
    for n, row in enumerate(shown):
        total = sum(v for _, _, v in row.segments)
        scale = (WIDTH / total if total else 0.0) if shares else (WIDTH / peak if peak else 0.0)
        parts.append(_row(row, n * ROW_H, scale))
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
        _legend((colour, name, "") for colour, name in legend),
    )
