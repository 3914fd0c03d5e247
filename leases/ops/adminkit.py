"""What every app's admin shares: admins bound to one database, a site per database,
the database clock read once per request, and how times and JSON are shown.

Whether a row is free, held, due or lapsed depends on the database clock, so each request
reads `db_now()` once and judges every row by that one reading (never the web server's
clock, which may be skewed from the one that decides expiry).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from django.contrib import admin
from django.contrib.auth import get_permission_codename
from django.db.models.options import Options
from django.http import HttpRequest
from django.urls import URLPattern, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases import db, routing
from leases.clock import db_now

#: What the live columns show when they do not apply (as the admin shows None in lists;
#: the change form would print "None").
EMPTY = "-"
#: The largest primary key of a BIGINT column (MySQL's and SQLite's integers are signed 64-bit).
BIGGEST_ID = 2**63 - 1


def nowrap(text: Any) -> SafeString:
    return format_html('<span style="white-space: nowrap">{}</span>', text)


def local_time(value: datetime | None) -> str:
    """The time in the current time zone to the second, with its offset: as the commands
    say it ("2026-11-26 05:09:15Z") where that zone is UTC; EMPTY for None."""
    if not value:
        return EMPTY
    local = timezone.localtime(value)
    offset = local.strftime("%z")
    zone = "Z" if offset in ("+0000", "") else f"{offset[:3]}:{offset[3:]}"
    return local.strftime("%Y-%m-%d %H:%M:%S") + zone


def compact_time(value: datetime | None) -> SafeString | None:  # None: the list's empty value
    """Compact and sortable, so a row of timestamps fits on one line."""
    return None if value is None else nowrap(local_time(value))


def pretty_json(value: object) -> SafeString:
    """JSON in a <pre>, indented and keys sorted, so nested payloads can be read and compared."""
    text = json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)
    return format_html('<pre style="margin: 0">{}</pre>', text)


def as_id(text: str) -> int | None:
    """`text` as a primary key: ASCII digits of a 63-bit integer, else None. str.isdigit()
    takes "²", which int() refuses, and a longer number overflows the column (a 500 either way)."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(BIGGEST_ID)):
        return None
    found = int(text)
    return found if found <= BIGGEST_ID else None


def may_change(request: HttpRequest, opts: Options) -> bool:
    """Whether the user holds the model's change permission, which the actions require
    where the forms are read-only."""
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")


class OnDatabase:
    """A model admin of the engine's rows on one database: `database`, else
    LEASES_DATABASE. `site_for(alias)` makes a site whose admins set it."""

    database: str | None = None

    @property
    def using(self) -> str:
        return self.database or db.alias()

    def admin_url(self, name: str, *args: Any) -> str:
        """A URL of this admin's own site (each database's site has its own names)."""
        return reverse(f"{self.admin_site.name}:{name}", args=args)

    def get_urls(self) -> list:
        """Every view tags its request with this admin, so what is computed per request
        (the database clock, links) knows its database and site."""

        def tagged(view: Any) -> Any:
            @functools.wraps(view)
            def inner(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                request.leases_admin = self
                return view(request, *args, **kwargs)

            return inner

        return [URLPattern(p.pattern, tagged(p.callback), p.default_args, p.name) if isinstance(p, URLPattern) else p
                for p in super().get_urls()]


class OnDatabaseInline:
    """An inline of an `OnDatabase` admin: its rows come from that admin's database."""

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).using(request.leases_admin.using)

    def admin_url(self, name: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:{name}", args=args)


def site_for(alias: str) -> admin.AdminSite:
    """An admin site showing the engine's rows on database `alias`, for a project whose
    pools and queues are spread over several (see leases.routing):
    ``path("admin/eu/", leases.admin.site_for("eu").urls)``. Made once per alias."""
    routing.known(alias)
    if alias not in _sites:
        site = admin.AdminSite(name=f"leases_{alias}")
        site.site_header = site.site_title = f"django-leases on database {alias}"
        for model, model_admin in admin.site._registry.items():
            if isinstance(model_admin, OnDatabase):
                site.register(model, type(type(model_admin).__name__, (type(model_admin),), {"database": alias}))
        _sites[alias] = site
    return _sites[alias]


_sites: dict[str, admin.AdminSite] = {}


def request_now(request: HttpRequest) -> datetime:
    """The database clock, read once per request: one instant for every row of the page."""
    try:
        return request._leases_now
    except AttributeError:
        admin_ = getattr(request, "leases_admin", None)
        request._leases_now = db_now(admin_.using if admin_ else db.alias())
        return request._leases_now


class PerRequest:
    """Columns that depend on the database clock, bound to one request's reading of it.

    Display methods get the row but not the request, and a ModelAdmin is shared by
    concurrent requests, so the clock reading cannot live on the admin. Cached on the
    request: the form machinery matches these bound methods by equality across calls.
    """

    def __init__(self, request: HttpRequest) -> None:
        self.request = request

    @property
    def using(self) -> str:
        """The database of the admin that serves the request."""
        return self.request.leases_admin.using

    def admin_url(self, name: str, *args: Any) -> str:
        return self.request.leases_admin.admin_url(name, *args)

    @classmethod
    def of(cls, request: HttpRequest):
        key = f"_leases_{cls.__name__}"
        if not hasattr(request, key):
            setattr(request, key, cls(request))
        return getattr(request, key)
