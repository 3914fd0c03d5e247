"""How the operator commands print: stored text made safe for a terminal, aligned
columns, JSON, times and durations; and how they read JSON arguments.

One rule for times, in every command: a moment is its UTC time (`clock`), with how far
it is from the database clock's now where that helps (`ago`: "in 14h",
"3m ago", in its largest whole unit, as the admin shows it; `when` gives both); how long
something took is a `span` ("2h05m"). Stored JSON prints as indented JSON (`as_json`)."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from leases.durations import whole


def shown(text: str) -> str:
    """`text` safe to print on a terminal: control and invisible characters (escape
    sequences, newlines, bidirectional overrides, zero-width spaces) as \\x.., \\u....

    Names are checked on the way in, but rows written earlier or through the ORM can
    hold anything, and a raw ESC would let a stored value drive the operator's terminal.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def parse_json(text: str, what: str) -> Any:
    """`text` as JSON; ValueError (one line) when it is not, or is nested too deeply to
    parse (json.loads raises RecursionError for that)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def as_json(value: Any) -> list[str]:
    """`value` as indented JSON lines, each safe for a terminal."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return [shown(line) for line in text.splitlines()]


def block(label: str, value: Any) -> str:
    """A stored JSON value under its label, indented: "payload:\n  {...}"; "label: -"
    for none."""
    if value is None:
        return f"{label}: -"
    return f"{label}:\n" + "\n".join("  " + line for line in as_json(value))


def clock(value: datetime | None) -> str:
    """A stored time as the operator reads it (UTC), or blank."""
    return f"{value:%Y-%m-%d %H:%M:%S}Z" if value else ""


def span(seconds: float) -> str:
    """A duration short enough for a table column: 40ms, 12.3s, 3m07s, 2h05m, 3d04h."""
    if seconds < 1:
        return f"{max(seconds, 0.0) * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def ago(moment: datetime, now: datetime) -> str:
    """'in 3s' or '2m ago' from `now` (the database clock)."""
    delta = (moment - now).total_seconds()
    return f"in {whole(delta)}" if delta > 0 else f"{whole(-delta)} ago"


def when(value: datetime | None, now: datetime) -> str:
    """A time and how far it is from `now`: 2026-01-02 03:04:05Z (in 3m); "-" for none."""
    return f"{clock(value)} ({ago(value, now)})" if value else "-"


def elapsed(start: datetime | None, end: datetime | None, now: datetime | None) -> str:
    """start to end, or to `now` for something still going (now=None: it is not); blank
    when it has not started."""
    stop = end or now
    return span((stop - start).total_seconds()) if start and stop else ""


def standing_cells(standing: Any) -> list[str]:
    """A `leases.targets.Standing` as table cells: USABLE (of the slots), NOT USABLE (how
    many for each reason), NEXT USABLE (when the first refused slot comes back, and why)."""
    usable = f"{standing.usable}{'+' if standing.partial else ''}/{standing.slots}"
    reasons = ", ".join(f"{count} {words}" for words, count in standing.counts()) or "-"
    if not standing.blocked:
        coming = "now"
    elif standing.next_at is not None:
        coming = f"{ago(standing.next_at, standing.now)} ({standing.next_why})"
    else:
        coming = "when a holder lets go" if standing.held else "-"
    return [usable, reasons, coming]


#: The most rows a listing's --limit may ask for.
MAX_LIMIT = 10_000


def limit_of(text: str) -> int:
    """A --limit option: a whole number from 1 to MAX_LIMIT (ValueError, one line)."""
    count = int(text) if text.isascii() and text.isdigit() else 0
    if not 1 <= count <= MAX_LIMIT:
        raise ValueError(f"--limit must be a whole number from 1 to {MAX_LIMIT}, not {text!r}")
    return count
