"""What a job carries: its payload as JSON text the database stores as it is (never
pickle), the key that dedupes it, and its priority."""
from __future__ import annotations

import hashlib
from typing import Any

from leases.encoding import dump_json

from ..models import KEY_LENGTH, PRIORITY_RANGE


def dump_payload(payload: Any, what: str = "payload") -> str:
    """JSON text the database stores as it is: ValueError for what JSON cannot carry, lone
    surrogates, nesting past 31 levels and LEASES_MAX_JSON_BYTES. Keys are sorted, so equal
    payloads are equal text (and have equal default keys)."""
    return dump_json(payload, what, sort_keys=True)


def default_key(name: str, payload_json: str) -> str:
    """A hash of the message: equal name and payload, equal key."""
    return hashlib.sha256(f"{name}\n{payload_json}".encode()).hexdigest()


def check_key(key: Any) -> str:
    """A dedupe key: a non-empty string of at most KEY_LENGTH characters, valid Unicode."""
    if not isinstance(key, str) or not key or len(key) > KEY_LENGTH:
        raise ValueError(f"key must be a non-empty string of at most {KEY_LENGTH} characters")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"key holds a lone surrogate (text that is not valid Unicode): {key!r}") from None
    return key


def check_priority(priority: Any) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise ValueError(f"priority must be a whole number from {low} to {high}, not {priority!r}")
    return priority
