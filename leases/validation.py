"""Checks of what callers hand the engine: names, durations and JSON values.

Every public call validates its input here before writing anything, so bad input is a
one-line ValueError and never a database error halfway through. The bounds are those of
the databases underneath: DATETIME(6) arithmetic overflows past year 9999, MariaDB's
JSON check refuses documents nested 32 levels deep or holding a lone UTF-16 surrogate,
and a statement larger than `max_allowed_packet` (16 MiB by default) is refused.
"""
from __future__ import annotations

import json
import math
import unicodedata
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

#: Longest duration anywhere (ttl, wait, delay, quarantine, timeout, age): ten years,
#: far beyond any lease, and still far inside DATETIME's range.
MAX_SECONDS = 10 * 365 * 86400
#: Shortest lease or lock: below this the hold can end before its reply arrives.
MIN_TTL = 0.1
#: Most slots (holders at once) of one resource: each is a row.
MAX_SLOTS = 1000
#: JSON nesting MariaDB's JSON_VALID accepts (32 levels are refused).
MAX_JSON_DEPTH = 31
#: Default size limit of a payload, a result or a resource's data, as UTF-8 JSON text.
MAX_JSON_BYTES = 1 << 20
#: Character classes never allowed in names: controls (NUL, newline, terminal escapes),
#: lone surrogates and invisible format characters (BOM, bidirectional overrides).
_FORBIDDEN = {"Cc", "Cs", "Cf"}


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


@lru_cache(maxsize=1)
def max_json_bytes() -> int:
    """settings.LEASES_MAX_JSON_BYTES, read once (a missing setting is slow to look up,
    and every push looks)."""
    value = getattr(settings, "LEASES_MAX_JSON_BYTES", MAX_JSON_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 8 * MAX_JSON_BYTES:
        raise ValueError(f"LEASES_MAX_JSON_BYTES must be a whole number from 1024 to {8 * MAX_JSON_BYTES}")
    return value


@receiver(setting_changed)
def _forget_limit(setting: str, **kwargs: Any) -> None:
    if setting == "LEASES_MAX_JSON_BYTES":
        max_json_bytes.cache_clear()


def dump_json(value: Any, what: str, sort_keys: bool = False) -> str:
    """`value` as compact JSON text that every supported database stores as it is.

    ValueError (one line, naming `what`) for what JSON cannot carry (NaN, sets, objects),
    nesting deeper than MAX_JSON_DEPTH, lone surrogates, and text over the size limit.
    """
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
    except RecursionError:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable: {exc}") from None
    try:
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds a lone surrogate (text that is not valid Unicode)") from None
    limit = max_json_bytes()
    if size > limit:
        raise ValueError(f"{what} is {size} bytes of JSON, over the limit of {limit} (LEASES_MAX_JSON_BYTES)")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return text


def _depth(value: Any) -> int:
    """Nesting of containers, iteratively (a recursive walk is what overflows)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


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
