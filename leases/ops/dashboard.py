"""The operator dashboard: one page of charts, drawn as inline SVG on the server.

Staff only (others are sent to the admin's login). The page extends the admin's base
template so it sits beside the admin, and shows the panels every installed app adds
(see `readings`). Like the metrics, it costs a fixed number of grouped queries however
large the tables are, with every time judged by the database clock, read once per page.
"""
from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from leases import db, routing
from leases.clock import db_now

from . import readings


@never_cache
@staff_member_required
def dashboard(request: HttpRequest) -> HttpResponse:
    """The page, in the admin's frame (its header, sidebar and theme); `?database=ALIAS`
    shows another database in use than LEASES_DATABASE."""
    try:
        using = routing.known(request.GET.get("database") or db.alias())
    except ValueError as exc:
        return HttpResponseBadRequest(f"{exc}\n", content_type="text/plain")
    now = db_now(using)
    title = "Leases dashboard" + ("" if using == db.alias() else f" of database {using}")
    context = {**admin.site.each_context(request), "title": title, "now": now,
               "panels": readings.panels(now, using)}
    return render(request, "leases/dashboard.html", context)
