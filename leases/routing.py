"""Which database each pool, lock, dispatcher and queue lives on.

``settings.LEASES_ROUTES`` maps names to database aliases, per kind::

    LEASES_ROUTES = {
        "pools": {"proxies-eu-*": "eu"},     # a trailing * matches a prefix
        "queues": {"crawl": "jobs", "crawl.*": "jobs"},
    }

A name no pattern matches lives on ``settings.LEASES_DATABASE`` ("default"). An explicit
``using=`` (``--database`` on the commands) always wins over the routes. Everything one
statement or transaction touches lives on one alias: a pool's slots and waiters, a lock,
a dispatcher's tasks and workers, a queue's jobs, settings and limits. Pipelines and
schedules live on LEASES_DATABASE with the queues they push to.

`LeasesRouter`, listed in ``DATABASE_ROUTERS``, sends this package's migrations to every
alias in use and its ORM reads and writes to LEASES_DATABASE unless told otherwise.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver
from django.utils.connection import ConnectionDoesNotExist

from . import db

KINDS = ("pools", "locks", "dispatchers", "queues")
#: The apps whose tables follow the routes.
APP_LABELS = ("leases", "leases_tasks", "leases_pipelines")


def _overlap(a: str, b: str) -> str | None:
    """A name both patterns match, or None."""
    a_prefix, b_prefix = a.endswith("*"), b.endswith("*")
    a_text, b_text = a.rstrip("*") if a_prefix else a, b.rstrip("*") if b_prefix else b
    if a_prefix and b_prefix:
        return max(a_text, b_text, key=len) if a_text.startswith(b_text) or b_text.startswith(a_text) else None
    if a_prefix:
        return b_text if b_text.startswith(a_text) else None
    if b_prefix:
        return a_text if a_text.startswith(b_text) else None
    return a_text if a_text == b_text else None


def problems(routes: Any) -> list[str]:
    """What is wrong with a LEASES_ROUTES value, one line each (empty when it is fine)."""
    if routes is None:
        return []
    if not isinstance(routes, dict):
        return [f"LEASES_ROUTES must be a dict of kinds ({', '.join(KINDS)}), not {type(routes).__name__}"]
    found = []
    for kind, patterns in routes.items():
        if kind not in KINDS:
            found.append(f"LEASES_ROUTES: unknown kind {kind!r} (use {', '.join(KINDS)})")
            continue
        if not isinstance(patterns, dict):
            found.append(f"LEASES_ROUTES[{kind!r}] must map name patterns to database aliases")
            continue
        for pattern, alias in patterns.items():
            if not isinstance(pattern, str) or not pattern.rstrip("*") or "*" in pattern.rstrip("*"):
                found.append(f"LEASES_ROUTES[{kind!r}]: pattern {pattern!r} must be a name, or a prefix and one"
                             " trailing *")
            elif alias not in settings.DATABASES:
                found.append(f"LEASES_ROUTES[{kind!r}][{pattern!r}] names {alias!r}, which is not in DATABASES")
        good = [(p, a) for p, a in patterns.items() if isinstance(p, str) and p.rstrip("*")]
        for i, (first, first_alias) in enumerate(good):
            for second, second_alias in good[i + 1 :]:
                both = _overlap(first, second)
                if both is not None and first_alias != second_alias:
                    found.append(f"LEASES_ROUTES[{kind!r}]: {first!r} and {second!r} both match {both!r} but name "
                                 f"different databases ({first_alias!r}, {second_alias!r})")
    return found


@lru_cache(maxsize=1)
def _routes() -> dict[str, list[tuple[str, bool, str]]]:
    """The checked routes: per kind, (name or prefix, is a prefix, alias)."""
    routes = getattr(settings, "LEASES_ROUTES", None)
    found = problems(routes)
    if found:
        raise ImproperlyConfigured(found[0])
    return {kind: [(p.rstrip("*"), p.endswith("*"), alias) for p, alias in (routes or {}).get(kind, {}).items()]
            for kind in KINDS}


@receiver(setting_changed)
def _forget(setting: str, **kwargs: Any) -> None:
    if setting in ("LEASES_ROUTES", "LEASES_DATABASE", "DATABASES"):
        _routes.cache_clear()


def route(kind: str, name: str, using: str | None = None) -> str:
    """The alias of the `kind` ("pools", "locks", "dispatchers", "queues") named `name`:
    `using` when given, else the route that matches, else LEASES_DATABASE."""
    if using:
        return known(using)
    return routed(kind, name) or db.alias()


def routed(kind: str, name: str) -> str | None:
    """The alias a pattern of LEASES_ROUTES sends `name` to, or None when none matches."""
    for text, prefix, alias in _routes()[kind]:
        if name == text or (prefix and name.startswith(text)):
            return alias
    return None


def check_queue_on(queue: str, using: str, what: str) -> None:
    """A job pushed in a transaction on `using` (a pipeline's task, a schedule's job) lands
    there: refuse a queue the routes send elsewhere, where its workers look."""
    elsewhere = routed("queues", queue)
    if elsewhere not in (None, using):
        raise ValueError(f"{what}: queue {queue!r} is routed to database {elsewhere!r}, but its jobs would be "
                         f"written on {using!r} (in one transaction with the rest)")


def known(alias: str) -> str:
    """`alias` if DATABASES has it; ValueError naming the aliases there are otherwise."""
    try:
        connections[alias]  # a wrapper (no connection yet); one set up at run time counts too
    except ConnectionDoesNotExist:
        raise ValueError(f"unknown database {alias!r} (DATABASES has {', '.join(connections.settings)})") from None
    return alias


def aliases() -> list[str]:
    """Every alias in use: LEASES_DATABASE first, then those the routes name."""
    found = [db.alias()]
    for patterns in _routes().values():
        found += [alias for _, _, alias in patterns if alias not in found]
    return found


class LeasesRouter:
    """A database router (``DATABASE_ROUTERS = ["leases.routing.LeasesRouter"]``): this
    package's tables on every alias in use, its ORM defaulting to LEASES_DATABASE."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return db.alias() if model._meta.app_label in APP_LABELS else None

    db_for_write = db_for_read

    def allow_migrate(self, alias: str, app_label: str, **hints: Any) -> bool | None:
        return alias in aliases() if app_label in APP_LABELS else None
