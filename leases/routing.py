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

from typing import Any

from django.db import connections
from django.utils.connection import ConnectionDoesNotExist

from . import conf, db

#: The apps whose tables follow the routes.
APP_LABELS = ("leases", "leases_tasks", "leases_pipelines")


def route(kind: str, name: str, using: str | None = None) -> str:
    """The alias of the `kind` ("pools", "locks", "dispatchers", "queues") named `name`:
    `using` when given, else the route that matches, else LEASES_DATABASE."""
    if using:
        return known(using)
    return conf.routed(kind, name) or db.alias()


def check_queue_on(queue: str, using: str, what: str) -> None:
    """A job pushed in a transaction on `using` (a pipeline's task, a schedule's job) lands
    there: refuse a queue the routes send elsewhere, where its workers look."""
    elsewhere = conf.routed("queues", queue)
    if elsewhere not in (None, using):
        raise ValueError(f"{what}: queue {queue!r} is routed to database {elsewhere!r}, but its jobs would be "
                         f"written on {using!r} (in one transaction with the rest)")


def database_of(queues: list[str], using: str | None = None) -> str:
    """The one database `queues` live on: `using`, else their routes'; ValueError when
    the routes send them to several."""
    if using or queues == ["*"]:
        return known(using) if using else db.alias()
    found = {name: route("queues", name) for name in queues}
    if len(set(found.values())) > 1:
        spread = ", ".join(f"{name} on {alias}" for name, alias in sorted(found.items()))
        raise ValueError(f"queues live on several databases ({spread}): one worker serves one database")
    return next(iter(found.values()))

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
    for patterns in conf.routes().values():
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

