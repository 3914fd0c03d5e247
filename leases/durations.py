"""Durations as operators type them: 90, 90s, 10m, 2h, 1d."""
from __future__ import annotations

from .validation import MAX_SECONDS, check_seconds

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in `text`: a number with an optional unit s, m, h or d; ValueError unless it
    is > 0 and at most MAX_SECONDS (ten years)."""
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in _UNITS else "s"
    number = raw[:-1] if raw[-1:] in _UNITS else raw
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 10m, 2h, 1d)") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"duration must be > 0: {text!r}")
    return check_seconds(seconds, f"duration {text!r}", above=True, maximum=MAX_SECONDS)
