"""JSON text that every supported database stores as it is: payloads, results, context,
resource data. Never pickle.

The bounds are the databases': MariaDB's JSON check refuses documents nested 32 levels
deep or holding a lone UTF-16 surrogate, and a statement larger than
`max_allowed_packet` (16 MiB by default) is refused; LEASES_MAX_JSON_BYTES caps the size.
"""
from __future__ import annotations

import json
from typing import Any

from . import conf

#: JSON nesting MariaDB's JSON_VALID accepts (32 levels are refused).
MAX_JSON_DEPTH = 31


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
    limit = conf.max_json_bytes()
    if size > limit:
        raise ValueError(f"{what} is {size} bytes of JSON, over the limit of {limit} (LEASES_MAX_JSON_BYTES)")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    return text


def load_json(value: Any) -> Any:
    """A JSON column as a raw cursor returns it (text or bytes, or already decoded)."""
    if isinstance(value, (bytes, bytearray)):
        value = value.decode()
    return json.loads(value) if isinstance(value, str) else value


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
