"""The colour of each status of a run, a stage or a task, wherever the admin shows one."""
from __future__ import annotations

from django.utils.html import format_html
from django.utils.safestring import SafeString

#: Colour of each status, in the list, the stage table and the timeline.
COLOURS = {
    "succeeded": "#2e9c4a",
    "running": "#d08700",
    "queued": "#e0b84a",
    "waiting": "#b5b5b5",
    "paused": "#4a7fd0",
    "failed": "#d3372c",
    "cancelled": "#7a7a7a",
    "skipped": "#d5d5d5",
}


def badge(status: str) -> SafeString:
    return format_html(
        '<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
        COLOURS.get(status, "#999"),
        status,
    )
