"""Prometheus metrics of the engine, read from the database when Prometheus scrapes.

Every figure is computed from the tables at scrape time by a custom collector, so any
number of web and worker processes expose the same numbers with no shared state and
nothing to keep in step. The collector reads the database clock once per scrape and
passes it to the metric families every installed app adds (see `readings`). A bearer
token reads every family; a staff user reads the families of the models they may view,
as on the dashboard. Only the collector and the view need `prometheus_client`, the
optional extra ``django-leases[metrics]``.
"""
from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from leases import conf, db, routing
from leases.clock import db_now

from . import readings
from .readings import May, everything

MISSING = "prometheus_client is not installed: pip install django-leases[metrics]\n"


class LeasesCollector:
    """A prometheus_client collector that reads the engine's tables at each collect().

    Registering it elsewhere (``REGISTRY.register(LeasesCollector())``) reads nothing:
    describe() names no metric, so the registry does not collect at registration.
    `may(permission)` says which families to collect (each needs a view permission on
    its model); the default collects all, the /metrics/ view passes its user's.
    """

    def __init__(self, using: str | None = None, may: May = everything) -> None:
        self.using = using
        self.may = may

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        using = db.alias(self.using)
        yield from readings.metric_families(db_now(using), using, self.may)


def viewer(request: HttpRequest) -> May | None:
    """What the request may read: everything with a bearer token equal to
    settings.LEASES_METRICS_TOKEN (compared in constant time), what a logged-in staff
    user may view, or nothing (None). The token is checked first: a scrape has no session."""
    token = conf.metrics_token()
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return everything
    user = getattr(request, "user", None)
    return user.has_perm if user is not None and user.is_active and user.is_staff else None


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The Prometheus text format, the families the viewer may read; 403 without access
    to any, 501 without prometheus_client. `?database=ALIAS` reads another database in
    use than LEASES_DATABASE (one scrape target per database)."""
    may = viewer(request)
    if may is None or not readings.sees_metrics(may):
        return HttpResponse(
            "Staff who may view the models the metrics read, or a bearer token.\n", status=403,
            content_type="text/plain",
        )
    try:
        using = routing.known(request.GET.get("database") or db.alias())
    except ValueError as exc:
        return HttpResponse(f"{exc}\n", status=400, content_type="text/plain")
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError:
        return HttpResponse(MISSING, status=501, content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LeasesCollector(using, may))
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
