"""What every app's admin shares: admins bound to one database, a site per database,
masked fields declared once, counts that stop at a limit, the database clock read once per
request, and how times and JSON are shown.

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
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import get_permission_codename
from django.core.exceptions import FieldDoesNotExist
from django.core.paginator import Paginator
from django.db import NotSupportedError
from django.db.models import Field, Model
from django.db.models.constants import LOOKUP_SEP
from django.db.models.options import Options
from django.http import HttpRequest
from django.urls import URLPattern, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases import db, routing
from leases.clock import db_now

from .masking import sees_stored

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


class AtLeast(int):
    """A count that stopped at its limit: reads '10000+' wherever the admin prints it."""

    def __str__(self) -> str:
        return f"{int(self)}+"


class CappedPaginator(Paginator):
    """Counts at most `limit` rows, so a page of a table of millions stays one index range.

    Past the limit the list says "10000+" and its page links stop there; filters narrow it.
    """

    def __init__(self, *args, limit: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limit = limit

    @cached_property
    def count(self) -> int:
        found = self.object_list.order_by().values("pk")[: self.limit + 1].count()
        return AtLeast(self.limit) if found > self.limit else found


def may_change(request: HttpRequest, opts: Options) -> bool:
    """Whether the user holds the model's change permission, which the actions require
    where the forms are read-only."""
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")


def fields_of(model: type[Model], path: str) -> list[Field]:
    """The model fields a lookup, search or ordering path goes through ("errors__message__icontains":
    Job.errors, JobError.message), up to the first part that is no field (a JSON key, a
    transform, a lookup); prefixes ("-", "^", "=", "@") ignored."""
    found: list[Field] = []
    for part in path.lstrip("-^=@").split(LOOKUP_SEP):
        try:
            field = model._meta.get_field(part)
        except FieldDoesNotExist:
            break
        found.append(field)
        if not field.is_relation:
            break
        model = field.related_model
    return found


class Masking:
    """An admin's masked fields, declared once in `masked`: paths from its model (through
    relations too, "errors__message") whose values a user who may not see them as stored
    (`masking.sees_stored`) gets masked on its pages, or does not get at all.

    The same declaration keeps them out of that user's changelist: no search on them, no
    filter (URL lookups included: Django's admin takes a lookup on any field of the model
    from the query string, and answers one `lookup_allowed` refuses with a 400), no `o=`
    ordering, no date drill-down. A count or an order that moved with a masked value would
    give it away, a character at a time. Who sees them as stored searches as before.
    """

    masked: tuple[str, ...] = ()

    def sees_stored(self, request: HttpRequest) -> bool:
        return sees_stored(request.user, self.opts)

    def masks(self, request: HttpRequest, field: str) -> bool:
        """Whether `field`, one of `masked`, is masked for the user of `request`."""
        return field in self.masked and not self.sees_stored(request)

    def shown(self, request: HttpRequest, field: str) -> str:
        """What a page shows of `field`: the field, or its masked display `masked_<field>`."""
        return f"masked_{field}" if self.masks(request, field) else field

    def reads_masked(self, request: HttpRequest | None, path: str) -> bool:
        """Whether `path` (a lookup, a search field, an ordering) reads a field masked for
        the user of `request`; without a request, any field of `masked`."""
        if not self.masked or (request is not None and self.sees_stored(request)):
            return False
        hidden = {fields_of(self.model, field)[-1] for field in self.masked}
        return not hidden.isdisjoint(fields_of(self.model, path))

    def lookup_allowed(self, lookup: str, value: Any, request: HttpRequest | None = None) -> bool:
        return not self.reads_masked(request, lookup) and super().lookup_allowed(lookup, value, request)

    def get_search_fields(self, request: HttpRequest):
        return [field for field in super().get_search_fields(request) if not self.reads_masked(request, field)]

    def get_list_filter(self, request: HttpRequest):
        """Filters by field path, but not by a masked one (filter classes read no masked field)."""
        def path(item: Any) -> str | None:
            item = item[0] if isinstance(item, (list, tuple)) else item
            return item if isinstance(item, str) else None

        return [item for item in super().get_list_filter(request)
                if path(item) is None or not self.reads_masked(request, path(item))]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return GuardedChangeList


class GuardedChangeList(ChangeList):
    """The changelist of a `Masking` admin: neither its `o=` ordering nor its date
    hierarchy reads a field masked for the user, and a URL lookup the database cannot do
    (a JSON `contains` on SQLite) is the admin's "?e=1" answer to a bad lookup, not a 500."""

    def __init__(self, request: HttpRequest, model: type[Model], list_display: Any, list_display_links: Any,
                 list_filter: Any, date_hierarchy: str | None, *args: Any, **kwargs: Any) -> None:
        self.viewer = request  # get_ordering_field runs inside ChangeList.__init__
        admin_ = args[5] if len(args) > 5 else kwargs["model_admin"]
        if date_hierarchy and admin_.reads_masked(request, date_hierarchy):
            date_hierarchy = None
        super().__init__(request, model, list_display, list_display_links, list_filter, date_hierarchy,
                         *args, **kwargs)
        columns = self.list_display if self.sortable_by is None else self.sortable_by
        self.sortable_by = [column for column in columns if not self._masked_order(column)]

    def _masked_order(self, column: Any) -> bool:
        try:
            found = super().get_ordering_field(column)
        except AttributeError:  # a column of no model field and no admin method
            return False
        name = found if isinstance(found, str) else getattr(getattr(found, "expression", found), "name", None)
        return isinstance(name, str) and self.model_admin.reads_masked(self.viewer, name)

    def get_ordering_field(self, field_name: Any) -> Any:
        return None if self._masked_order(field_name) else super().get_ordering_field(field_name)

    def get_results(self, request: HttpRequest) -> None:
        try:
            super().get_results(request)
        except NotSupportedError as exc:
            raise IncorrectLookupParameters(exc) from exc


class OnDatabase(Masking):
    """A model admin of the engine's rows on one database: `database`, else
    LEASES_DATABASE. `site_for(alias)` makes a site whose admins set it. Its masked
    fields are declared in `masked` (see `Masking`)."""

    database: str | None = None

    @property
    def using(self) -> str:
        return self.database or db.alias()

    def admin_url(self, name: str, *args: Any) -> str:
        """A URL of this admin's own site (each database's site has its own names)."""
        return reverse(f"{self.admin_site.name}:{name}", args=args)

    def response_action(self, request: HttpRequest, queryset: Any, *args: Any, **kwargs: Any) -> Any:
        """An action's selection without what is no row's id (a stale or forged form): the
        ORM would raise on it (a 500); with nothing left the admin says nothing was selected."""
        selected = request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME)
        ids = [pk for pk in selected if as_id(pk) is not None]
        if ids != selected:
            request.POST = request.POST.copy()
            request.POST.setlist(admin.helpers.ACTION_CHECKBOX_NAME, ids)
        return super().response_action(request, queryset, *args, **kwargs)

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
