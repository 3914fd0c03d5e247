"""Durations as operators type them (90, 90s, 10m, 2h, 1d) and read them (3m, 2h)."""
from __future__ import annotations

from .validation import MAX_SECONDS, check_seconds

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_EXAMPLES = "use e.g. 90s, 10m, 2h, 1d"


def parse_duration(text: str, *, zero: bool = False, unit: bool = False) -> float:
    """Seconds in `text`: a number with an optional unit s, m, h or d; ValueError unless it
    is > 0 (>= 0 with `zero`) and at most MAX_SECONDS (ten years). With `unit` a bare
    number is refused: where "7" could mean days as well as seconds, say which."""
    raw = text.strip().lower()
    has_unit = raw[-1:] in _UNITS
    number = raw[:-1] if has_unit else raw
    try:
        seconds = float(number) * _UNITS[raw[-1] if has_unit else "s"]
    except ValueError:
        raise ValueError(f"not a duration: {text!r} ({_EXAMPLES})") from None
    if unit and not has_unit:
        raise ValueError(f"{text!r} needs a unit: {number}s, {number}m, {number}h or {number}d?")
    if not (seconds >= 0 if zero else seconds > 0) or seconds == float("inf"):
        raise ValueError(f"duration must be {'>= 0' if zero else '> 0'}: {text!r}")
    return check_seconds(seconds, f"duration {text!r}", above=not zero, maximum=MAX_SECONDS)


def whole(seconds: float) -> str:
    """A duration in its largest whole unit, short for a column: 3s, 2m, 5h, 4d."""
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
