"""A run's tasks over time, as inline SVG drawn on the server: one bar per task on a
common axis, no script, a tooltip per bar."""
from __future__ import annotations

from datetime import datetime

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from leases.management.text import span
from leases.ops.adminkit import local_time

from ..report import Timeline
from .badges import COLOURS

#: The timeline's geometry, in pixels.
LABEL_WIDTH, AXIS_WIDTH, ROW_HEIGHT, AXIS_HEIGHT = 200, 600, 16, 22
#: Tick spacings the timeline's axis may use, in seconds.
TICKS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
)


def _tick(seconds: float) -> float:
    """The axis step giving about six ticks over `seconds`."""
    return next((step for step in TICKS if seconds / step <= 8), TICKS[-1] * (seconds // (TICKS[-1] * 8) + 1))


def _px(value: float) -> str:
    return f"{value:.1f}"


def svg_timeline(found: Timeline, now: datetime | None) -> SafeString:
    """One bar per task on a common time axis (stages in order), as inline SVG: no script,
    a tooltip per bar, a line at now while the run is live."""
    width = LABEL_WIDTH + AXIS_WIDTH + 10
    height = AXIS_HEIGHT + ROW_HEIGHT * len(found.bars) + 6
    label = f"timeline of {len(found.bars)} task(s) over {span(found.seconds)}"
    parts = [format_html(
        '<svg class="leases-timeline" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" role="img"'
        ' aria-label="{}" style="font: 11px sans-serif; background: #fff">', width, height, label,
    )]
    step, tick = _tick(found.seconds), 0.0
    while tick <= found.seconds + 1e-9:
        x = _px(LABEL_WIDTH + AXIS_WIDTH * tick / found.seconds)
        parts.append(format_html(
            '<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#e4e4e4"/>'
            '<text x="{0}" y="12" text-anchor="middle" fill="#666">{3}</text>',
            x, AXIS_HEIGHT - 6, height, span(tick) if tick else "0",
        ))
        tick += step
    previous = None
    for row, bar in enumerate(found.bars):
        y = AXIS_HEIGHT + row * ROW_HEIGHT
        first = bar.stage.pk != previous
        previous = bar.stage.pk
        if first and row:
            parts.append(format_html('<line x1="0" y1="{0}" x2="{1}" y2="{0}" stroke="#bbb"/>', y, width))
        name = f"{bar.stage.name}: {bar.task}" if first else str(bar.task)
        start = LABEL_WIDTH + AXIS_WIDTH * found.offset(bar.start)
        end = LABEL_WIDTH + AXIS_WIDTH * found.offset(bar.end)
        took = span((bar.end - bar.start).total_seconds())
        parts.append(format_html(
            '<text x="{}" y="{}" fill="#333">{}</text><rect x="{}" y="{}" width="{}" height="{}" fill="{}">'
            "<title>{} / {}: {}, {} from {}</title></rect>",
            4 if first else 16, y + ROW_HEIGHT - 4, name[:38], _px(start), y + 2, _px(max(end - start, 2.0)),
            ROW_HEIGHT - 4, COLOURS.get(bar.status, "#999"), bar.stage.name, bar.task, bar.status, took,
            local_time(bar.start),
        ))
    if now is not None:
        parts.append(format_html(
            '<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#4a7fd0" stroke-dasharray="3,2">'
            "<title>now</title></line>",
            _px(LABEL_WIDTH + AXIS_WIDTH * found.offset(now)), AXIS_HEIGHT - 6, height,
        ))
    legend = format_html_join(
        " ", '<span style="white-space: nowrap"><span style="color: {}">■</span> {}</span>',
        ((COLOURS[status], status) for status in ("succeeded", "running", "failed", "cancelled")),
    )
    note = f"; {found.not_started} task(s) listed above have not started" if found.not_started else ""
    return format_html(
        '<div style="overflow-x: auto">{}</svg></div><p class="help">{} ({} from {}{})</p>',
        mark_safe("".join(parts)),  # noqa: S308 - each part was built by format_html
        legend, span(found.seconds), local_time(found.origin), note,
    )
