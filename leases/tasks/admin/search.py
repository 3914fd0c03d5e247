"""The job list's search box: a job by its id, payload fields by their value, and names,
keys and limit keys by prefix.

A payload term becomes a JSON key lookup of the ORM, so its field and value reach the
database as parameters, on SQLite and MySQL/MariaDB alike. Payloads are not indexed: a
payload term reads the newest PAYLOAD_SCAN jobs, no more, so the page stays quick on a
table of millions.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet
from django.db.models.fields.json import KeyTransform
from django.utils.text import smart_split, unescape_string_literal

#: Newest jobs (by id) a payload term reads.
PAYLOAD_SCAN = 100_000
HELP = (
    "A job's id (123, #123); the start of a name, key or limit key; a payload field: payload.url:example.com "
    "(contains, any case), payload.n=5 (equals, any case; 5 and \"5\" alike), payload.a.b:x (nested). "
    f"Payload terms read the newest {PAYLOAD_SCAN:,} jobs."
)
_TERM = re.compile(r"payload\.(?P<path>[^\s:=]*)(?P<op>[:=])(?P<value>.*)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class PayloadTerm:
    """payload.a.b:x: the field at keys ("a", "b") contains "x" (lookup icontains);
    payload.a=5: its text is 5 (iexact: 5 and "5" alike, as MariaDB compares them anyway);
    payload.a=true: it is JSON true (exact; false and null too)."""

    keys: tuple[str, ...]
    lookup: str
    value: Any


@dataclass(frozen=True)
class Terms:
    """A search split in two: the payload terms, and the words for the admin's search."""

    payload: list[PayloadTerm]
    words: str


def split(search: str) -> Terms:
    """The payload terms of `search`, and the rest as it was typed. ValueError, in one
    line, for a payload term that cannot be read."""
    payload, words = [], []
    for term in smart_split(search):
        if term.lower().startswith("payload."):
            payload.append(_payload_term(term))
        else:
            words.append(term)
    return Terms(payload, " ".join(words))


def _payload_term(term: str) -> PayloadTerm:
    found = _TERM.fullmatch(term)
    if found is None:
        raise ValueError(f"{term!r}: a payload term is payload.FIELD:text or payload.FIELD=value")
    keys = tuple(found["path"].split("."))
    if not all(keys):
        raise ValueError(f"{term!r}: name the field after 'payload.', dots between nested names")
    if not found["value"]:
        raise ValueError(f"{term!r}: give the value after {found['op']!r}")
    if found["op"] == ":":
        return PayloadTerm(keys, "icontains", _unquoted(found["value"]))
    if found["value"] in ("true", "false", "null"):
        return PayloadTerm(keys, "exact", json.loads(found["value"]))
    return PayloadTerm(keys, "iexact", _unquoted(found["value"]))


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return unescape_string_literal(value)
    return value


def by_payload(queryset: QuerySet, terms: list[PayloadTerm]) -> QuerySet:
    """The jobs among the newest PAYLOAD_SCAN whose payload matches every term. Each
    field is a KeyTransform alias, so any key works (one named "exact" too)."""
    newest = queryset.model.objects.using(queryset.db).order_by("-pk").values_list("pk", flat=True).first()
    if newest is not None:
        queryset = queryset.filter(pk__gt=newest - PAYLOAD_SCAN)
    for n, term in enumerate(terms):
        field: Any = "payload"
        for key in term.keys:
            field = KeyTransform(key, field)
        queryset = queryset.alias(**{f"payload_term_{n}": field}).filter(
            **{f"payload_term_{n}__{term.lookup}": term.value})
    return queryset
