"""The operator dashboard: one page of charts, drawn as inline SVG on the server, that
refreshes itself.

Staff only (others are sent to the admin's login), and a staff user sees the panels of
the models they may view, as the admin would show them; one who may view none gets 403.
The page extends the admin's base template so it sits beside the admin, and shows the
panels every installed app adds (see `readings`). Like the metrics, it costs a fixed
number of grouped queries however large the tables are, with every time judged by the
database clock, read once per page.

Live, the page asks for itself again every `EVERY` seconds through htmx (see `htmx`):
that request carries HX-Request, and the answer is each panel and the controls as a
fragment htmx swaps in by its id (out of band), so nothing reloads. Pause and Resume are
links to the page with ``?live=0`` or ``?live=1``, fetched the same way; they work as
plain links too. No script is written for it: the behaviour is htmx's attributes.
"""
from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.utils.cache import patch_vary_headers
from django.views.decorators.cache import never_cache
from django_htmx.middleware import HtmxDetails

from leases import db, routing
from leases.clock import db_now

from . import htmx, readings

#: Seconds between two refreshes of a live page.
EVERY = 5


def _links(request: HttpRequest) -> dict[str, str]:
    """The page live and paused, on the same database."""
    database = {"database": request.GET["database"]} if request.GET.get("database") else {}
    return {state: f"{request.path}?{urlencode({**database, 'live': flag})}"
            for state, flag in (("live", 1), ("paused", 0))}


@never_cache
@staff_member_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The page, in the admin's frame (its header, sidebar and theme), or its panels for
    htmx to swap in; `?database=ALIAS` shows another database in use than
    LEASES_DATABASE, `?live=0` a page that stays as it is."""
    may = request.user.has_perm
    if not readings.sees_panels(may):
        raise PermissionDenied("You may view none of the models the dashboard reads.")
    live = request.GET.get("live", "1")
    if live not in ("0", "1"):
        return HttpResponseBadRequest("live must be 0 or 1\n", content_type="text/plain")
    try:
        using = routing.known(request.GET.get("database") or db.alias())
    except ValueError as exc:
        return HttpResponseBadRequest(f"{exc}\n", content_type="text/plain")
    now = db_now(using)
    context = {"now": now, "panels": readings.panels(now, using, may), "live": live == "1", "every": EVERY,
               "links": _links(request)}
    if HtmxDetails(request):
        response = render(request, "leases/dashboard/refresh.html", context)
    else:
        title = "Leases dashboard" + ("" if using == db.alias() else f" of database {using}")
        context.update(admin.site.each_context(request), title=title, htmx=htmx.script_url())
        response = render(request, "leases/dashboard.html", context)
    patch_vary_headers(response, ("HX-Request",))  # a page and its fragments share a URL
    return response
