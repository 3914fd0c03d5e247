"""Checks of what callers hand the engine: names, durations, counts and options.

Every public call validates its input here before writing anything, so bad input is a
one-line ValueError and never a database error halfway through. The bounds are those of
the databases underneath: DATETIME(6) arithmetic overflows past year 9999. Nothing here
reads settings, so the settings module (`leases.conf`) checks its values with these too.
"""
from __future__ import annotations

import math
import unicodedata
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

#: Longest duration anywhere (ttl, wait, delay, quarantine, timeout, age): ten years,
#: far beyond any lease, and still far inside DATETIME's range.
MAX_SECONDS = 10 * 365 * 86400
#: Shortest lease or lock: below this the hold can end before its reply arrives.
MIN_TTL = 0.1
#: Most slots (holders at once) of one resource: each is a row.
MAX_SLOTS = 1000
#: Most tries of one job.
MAX_ATTEMPTS = 1000
#: Longest queue name (the column's size).
QUEUE_LENGTH = 100
#: Longest pool, resource and target names (their columns' sizes): here, not beside the
#: models, so that the job queue's models can size their columns without importing the
#: base app's (which an app missing from INSTALLED_APPS could not).
POOL_NAME_LENGTH = 100
RESOURCE_NAME_LENGTH = 255
TARGET_LENGTH = 255
#: Character classes never allowed in names: controls (NUL, newline, terminal escapes),
#: lone surrogates and invisible format characters (BOM, bidirectional overrides).
_FORBIDDEN = {"Cc", "Cs", "Cf"}

#: A job's backoff: the base of an exponential backoff in seconds, or a function of the
#: failed attempt's number returning the seconds to wait.
Backoff = float | Callable[[int], float]


def check_name(value: Any, what: str, max_length: int) -> str:
    """A name an operator can type and read: non-empty, printable, no outer spaces."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    if len(value) > max_length:
        raise ValueError(f"{what} is longer than {max_length} characters: {value[:40]!r}...")
    if value != value.strip():
        raise ValueError(f"{what} must not start or end with whitespace: {value!r}")
    if not value.isprintable():  # rare: look closer (non-ASCII spaces, for one, are fine)
        for char in value:
            if unicodedata.category(char) in _FORBIDDEN:
                raise ValueError(f"{what} must not contain control or invisible characters: {value[:40]!r}")
    return value


def check_seconds(
    value: Any,
    what: str,
    *,
    minimum: float = 0.0,
    above: bool = False,
    maximum: float = MAX_SECONDS,
) -> float:
    """A finite number of seconds in [minimum, maximum] (or (minimum, maximum] with `above`).

    A timedelta is taken as its seconds; booleans and NaN are refused.
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (value <= minimum if above else value < minimum)
    ):
        low = f"> {minimum:g}" if above else f">= {minimum:g}"
        raise ValueError(f"{what} must be a finite number of seconds {low}, not {value!r}")
    if value > maximum:
        raise ValueError(f"{what} must be at most {maximum:g} seconds ({_human(maximum)}), not {value!r}")
    return float(value)


def check_ttl(ttl: Any, what: str = "ttl") -> float:
    """How long a lease or lock is held: MIN_TTL to MAX_SECONDS."""
    value = check_seconds(ttl, what, minimum=0.0, above=True)
    if value < MIN_TTL:
        raise ValueError(f"{what} must be at least {MIN_TTL:g} seconds, not {ttl!r}")
    return value


def check_wait(wait: Any) -> float:
    return check_seconds(wait, "wait")


def check_cooldown(cooldown: Any) -> float:
    """How long a released slot rests before it is handed out again: 0 to MAX_SECONDS."""
    return check_seconds(cooldown, "cooldown")


def check_slots(slots: Any) -> int:
    """How many holders a resource may have at once: 1 to MAX_SLOTS."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be a whole number from 1 to {MAX_SLOTS}, not {slots!r}")
    return slots


def check_moment(value: Any, what: str) -> datetime:
    """An aware datetime within MAX_SECONDS of now (by this host's clock: input sanity only)."""
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, not {value!r}")
    now = datetime.now(timezone.utc)
    if abs((value - now).total_seconds()) > MAX_SECONDS:
        raise ValueError(f"{what} must be within {_human(MAX_SECONDS)} of now, not {value.isoformat()}")
    return value


def check_queue(queue: Any) -> str:
    """A queue name: printable, and without commas (workers take comma-separated lists)."""
    check_name(queue, "queue", QUEUE_LENGTH)
    if "," in queue:
        raise ValueError(f"queue must be a name without commas, not {queue!r}")
    return queue


def check_attempts(value: Any) -> int:
    """Tries of a job: 1 to MAX_ATTEMPTS."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ATTEMPTS:
        raise ValueError(f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS}, not {value!r}")
    return value


def check_backoff(value: Any) -> Backoff:
    """Seconds >= 0 (the base of an exponential backoff) or a callable(attempt)."""
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"backoff must be seconds >= 0 or a callable(attempt), not {value!r}")
    return float(value)


def check_timeout(value: Any) -> float | None:
    """Seconds an attempt may run, or None for no limit."""
    return None if value is None else check_seconds(value, "timeout", above=True)


def clean_text(text: str, limit: int) -> str:
    """`text` made storable and bounded: lone surrogates escaped, at most `limit` characters
    (the head and the tail kept, as the end of a traceback matters most)."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    marker = f" [... {len(text) - limit} characters cut ...] "
    keep = max(0, limit - len(marker))
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2) :]


def _human(seconds: float) -> str:
    years = seconds / (365 * 86400)
    return f"{years:g} years" if years >= 1 else f"{seconds:g}s"


def check_target(target: Any) -> str:
    """A target key (a site): a printable string of at most TARGET_LENGTH characters."""
    if not isinstance(target, str):
        raise ValueError(f"a target must be a string, not {type(target).__name__} {target!r}")
    return check_name(target, "target", TARGET_LENGTH)
