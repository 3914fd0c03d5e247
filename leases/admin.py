"""Admin for resources: live lease state to look at, engine calls to change it.

Presentation only. Whether a resource is free, held or quarantined depends on the
database clock, so each request reads `db_now()` once and judges every row by that one
reading (never the web server's clock, which may be skewed from the one that decides
expiry). Lease state changes only through `Pool` methods, which use the server clock
and bump fencing tokens; the change form edits pool, name and data and nothing else.
"""
from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator

from . import db, routing
from .durations import parse_duration
from .exceptions import UnknownResource
from .locks import break_lock
from .models import EPOCH, Lock, Resource
from .pool import Pool, check_data, db_now
from .validation import MAX_SLOTS

#: Keys and names holding any of these, in any case and anywhere, are secret ("pass" covers
#: passwd and passphrase, "auth" authorization, "cred" credentials).
SECRET_WORDS = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "cred", "session", "private")
MASK = "••••••"
#: What the live columns show when they do not apply (as the admin shows None in lists;
#: the change form would print "None").
EMPTY = "-"
_WORDS = "|".join(SECRET_WORDS)
_SECRET_WORD = re.compile(_WORDS, re.IGNORECASE)
#: The password of "[scheme://]user:password@host", as proxy and database URLs carry it,
#: with or without a scheme. It is often unescaped ("p@ss", "pa/ss"), so it runs to the last
#: "@" of the whitespace-delimited token. A first colon followed by "//" is the scheme's,
#: and the user then ends at the next colon, whatever follows it.
_USERINFO = re.compile(r"(?<!\S)([^\s:]*://[^\s:]*:|[^\s:]*:(?!//))\S*@")
#: A secret-looking name, bare (api_key, X-Auth-Token) or quoted as a dict's repr or JSON
#: quotes keys, and its value: after "=" up to whitespace or "&" (the next query parameter),
#: after ":" the rest of the line (a header: "Authorization: Basic dXNl..."). A quoted value
#: keeps its quotes if it ends there ("'a'b" is masked whole). A bare name ending in Error,
#: Exception or Warning is the exception of a traceback's last line ("KeyError: 'token'").
#: Names are matched as whole runs (lookbehind, then a lookahead for the word) to keep the
#: search linear on long runs.
_PAIR = re.compile(
    rf"""
    (?P<name>
        (?<![\w.-]) (?=[\w.-]*(?:{_WORDS})) [\w.-]+
        (?<!(?-i:Error)) (?<!(?-i:Exception)) (?<!(?-i:Warning))
      | (?P<q>['"]) (?=[^'"\n]*(?:{_WORDS})) [^'"\n]+ (?P=q)
    )
    (?P<sep> [ \t]* (?:(?P<eq>=+)|:) [ \t]* )
    (?P<value>
        (?P<vq>['"]) (?:(?!(?P=vq))[^\\\n] | \\.)* (?P=vq) (?=[\s&,;)\]}}]|$)
      | (?(eq) (?:(?:bearer|basic|digest)[ \t]+)?[^\s&]+ | \S[^\n]* )
    )
    """,
    re.IGNORECASE | re.VERBOSE,
)

EDITABLE = ("pool", "name", "data")
LEASE_STATE = ("busy_until", "holder", "token", "acquired", "renewed", "quarantined", "quarantine_reason")
_COLOURS = {Resource.FREE: "#2e9c4a", Resource.HELD: "#d08700", Resource.COOLING: "#4a7fd0",
            Resource.QUARANTINED: "#d3372c"}


def _nowrap(text: Any) -> str:
    return format_html('<span style="white-space: nowrap">{}</span>', text)


def compact_time(value: datetime | None) -> str | None:  # None: the list's empty value
    """Compact and sortable, so a row of timestamps fits on one line."""
    return None if value is None else _nowrap(timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S"))


def is_secret(key: Any) -> bool:
    return isinstance(key, str) and _SECRET_WORD.search(key) is not None


def _masked_pair(match: re.Match) -> str:
    quote = match["vq"] or ""
    return f"{match['name']}{match['sep']}{quote}{MASK}{quote}"


def mask_text(text: str) -> str:
    """`text` (a message, a traceback, a string in JSON) with the credentials it may carry
    masked: URL passwords and the values of secret-looking names (see _USERINFO, _PAIR).

    Deliberately broad, as mask_secrets: a harmless value masked now and then costs less
    than a credential shown to everyone with view access.
    """
    return _PAIR.sub(_masked_pair, _USERINFO.sub(rf"\1{MASK}@", text))


def mask_secrets(value: Any) -> Any:
    """`value` with secret-looking keys' values (whole subtrees) masked, and its strings
    through mask_text.

    Deliberately broad ("monkey" contains "key"): showing a harmless value masked costs
    less than showing a credential to everyone with view access.
    """
    if isinstance(value, dict):
        return {k: MASK if is_secret(k) else mask_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    if isinstance(value, str):
        return mask_text(value)
    return value


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


class Live(PerRequest):
    """The resource columns."""

    def _state(self, obj: Resource) -> str:
        return obj.state_at(request_now(self.request))

    @admin.display(description="state")
    def state(self, obj: Resource) -> str:
        """The state, and for a quarantined slot why and until when, in one cell."""
        state = self._state(obj)
        dot = format_html('<span style="color: {}">●</span> {}', _COLOURS[state], state)
        if state == Resource.QUARANTINED:
            dot = format_html('{}: {} (until {})', dot, obj.quarantine_reason or "no reason given",
                              compact_time(obj.quarantined_until))
        return _nowrap(dot)

    @admin.display(description="holder", ordering="holder")
    def current_holder(self, obj: Resource) -> str:
        # The row keeps the last holder after expiry; it only means something while held.
        return _nowrap(obj.holder) if self._state(obj) == Resource.HELD else EMPTY

    @admin.display(description="expires in (s)", ordering="busy_before")
    def expires_in(self, obj: Resource) -> int | str:
        """Seconds to the end of the lease, of the rest after a release, or of the quarantine."""
        state = self._state(obj)
        if state == Resource.FREE:
            return EMPTY
        end = obj.quarantined_until if state == Resource.QUARANTINED else obj.busy_before
        return math.floor((end - request_now(self.request)).total_seconds())

    @admin.display(description="slots used")
    def used(self, obj: Resource) -> str:
        """Held slots of this slot's resource, of its slots."""
        return f"{obj.n_held}/{obj.n_slots}"


def held_at(now: datetime) -> Q:
    """Slots held at `now`, as SQL (the rules of Resource.state_at)."""
    return Q(busy_before__gt=now) & ~Q(holder="") & ~Q(quarantined_until__gt=now)


class StateFilter(admin.SimpleListFilter):
    """Free, held, cooling or quarantined by the database clock, as SQL (same rules as state_at)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [(s, s) for s in Resource.STATES]

    def queryset(self, request, queryset):
        value = self.value()
        if value is None:
            return queryset
        now = request_now(request)
        if value == Resource.FREE:
            return queryset.filter(busy_before__lte=now)
        if value == Resource.HELD:
            return queryset.filter(held_at(now))
        if value == Resource.COOLING:
            return queryset.filter(busy_before__gt=now, holder="").exclude(quarantined_until__gt=now)
        if value == Resource.QUARANTINED:
            return queryset.filter(quarantined_until__gt=now)
        return queryset.none()


class ResourceForm(forms.ModelForm):
    def clean_data(self):
        # The form's JSON parser takes NaN, which the database's JSON check refuses (a 500).
        try:
            return check_data(self.cleaned_data["data"])
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


class ResourceAddForm(ResourceForm):
    """A new resource and its slots (a slot's row is then edited on its own page)."""

    slots = forms.IntegerField(min_value=1, max_value=MAX_SLOTS, initial=1,
                               help_text="Holders it may have at once, each with a lease of its own.")


class QuarantineForm(forms.Form):
    """How long and why, for the quarantine action."""

    duration = forms.CharField(initial="1d", help_text="e.g. 90m, 2h, 1d (by the database clock).")
    reason = forms.CharField(max_length=255, help_text="Said to whoever looks at the resource next.")

    def clean_duration(self) -> float:
        try:
            return parse_duration(self.cleaned_data["duration"])
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


@admin.register(Resource)
class ResourceAdmin(OnDatabase, admin.ModelAdmin):
    """Resources on the engine's database (settings.LEASES_DATABASE)."""

    form = ResourceForm
    list_filter = (StateFilter, "pool")
    search_fields = ("pool", "name", "holder")
    actions = ("release_selected", "quarantine_selected", "unquarantine_selected")

    # -- the engine's database --------------------------------------------------------

    def get_queryset(self, request):
        """Each slot with how many slots its resource has and holds (by the database clock)."""
        siblings = Resource.objects.filter(pool=OuterRef("pool"), name=OuterRef("name")).order_by().values("name")
        held = siblings.filter(held_at(request_now(request)))
        return super().get_queryset(request).using(self.using).annotate(
            n_slots=Subquery(siblings.annotate(n=Count("*")).values("n")),
            n_held=Coalesce(Subquery(held.annotate(n=Count("*")).values("n")), 0),
        )

    def get_form(self, request, obj=None, change=False, **kwargs):
        kwargs["form"] = ResourceForm if obj is not None else ResourceAddForm
        return super().get_form(request, obj, change, **kwargs)

    def save_model(self, request, obj, form, change):
        # A change saves only the edited fields: the row was read before a worker may
        # have claimed or renewed it, and writing back the stale lease columns (token,
        # busy_before, holder) would silently take the lease away or hand it back. The
        # data is the resource's: every slot of it gets the new data.
        if not change:
            Pool(obj.pool, self.using).add(obj.name, obj.data, slots=form.cleaned_data["slots"])
            obj.pk = Resource.objects.using(self.using).get(pool=obj.pool, name=obj.name, slot=0).pk
            return
        fields = [f for f in form.changed_data if f in EDITABLE]
        siblings = Resource.objects.using(self.using).filter(pool=form.initial["pool"], name=form.initial["name"])
        siblings.exclude(pk=obj.pk).update(**{field: getattr(obj, field) for field in fields})
        obj.save(using=self.using, update_fields=fields)

    def delete_model(self, request, obj):
        obj.delete(using=self.using)

    # -- list -------------------------------------------------------------------------

    def get_list_display(self, request):
        live = Live.of(request)
        return ("name", "pool", "slot", live.used, live.state, live.current_holder, live.expires_in, "token",
                "acquired", "data_preview")

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Resource) -> str | None:
        return compact_time(obj.acquired_at)

    @admin.display(description="renewed", ordering="renewed_at")
    def renewed(self, obj: Resource) -> str | None:
        return compact_time(obj.renewed_at)

    @admin.display(description="busy until", ordering="busy_before")
    def busy_until(self, obj: Resource) -> str | None:
        """When the last lease, rest or quarantine ends; nothing for a slot never held."""
        return None if obj.busy_before == EPOCH else compact_time(obj.busy_before)

    @admin.display(description="quarantined until", ordering="quarantined_until")
    def quarantined(self, obj: Resource) -> str | None:
        return compact_time(obj.quarantined_until)

    @admin.display(description="data")
    def data_preview(self, obj: Resource) -> str:
        """Masked JSON, cut short to keep rows one line high; the whole of it on hover."""
        text = json.dumps(mask_secrets(obj.data), ensure_ascii=False, sort_keys=True)
        short = Truncator(text).chars(60)
        title = format_html(' title="{}"', text) if short != text else ""
        return format_html('<span style="white-space: nowrap"{}>{}</span>', title, short)

    # -- forms ------------------------------------------------------------------------

    def get_fieldsets(self, request, obj=None):
        """Add: pool, name, data. Change: those plus the lease state, read-only.

        Users who may change the resource see and edit `data` as stored, secrets
        included (they need them to edit it, and could read them from the database
        anyway); view-only users get it masked, as in the list.
        """
        if obj is None:
            return [(None, {"fields": (*EDITABLE, "slots")})]
        data = "data" if self.has_change_permission(request, obj) else "masked_data"
        live = Live.of(request)
        lease = (live.state, live.expires_in, *LEASE_STATE)
        return [
            (None, {"fields": ("pool", "name", data)}),
            ("Lease state", {
                "fields": lease,
                "description": "Changed only through the actions of the resource list "
                               "(release, quarantine, unquarantine), by the database clock.",
            }),
        ]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        live = Live.of(request)
        return (*LEASE_STATE, live.state, live.expires_in, "masked_data")

    @admin.display(description="data")
    def masked_data(self, obj: Resource) -> str:
        text = json.dumps(mask_secrets(obj.data), ensure_ascii=False, indent=2, sort_keys=True)
        return format_html('<pre style="margin: 0">{}</pre>', text)

    # -- actions: through the engine ----------------------------------------------------

    def _each(self, request, queryset, call, verb: str, skipped: str, note: str = "") -> None:
        """Apply `call(pool, name)` to each selected resource (every slot of it) through the
        engine, and record it in each row's history."""
        done = total = 0
        seen = set()
        for row in queryset.order_by("pool", "name", "slot"):
            if (row.pool, row.name) in seen:
                continue  # one call acts on every slot of the resource
            seen.add((row.pool, row.name))
            total += 1
            try:
                changed = call(Pool(row.pool, self.using), row.name) is not False
            except UnknownResource:  # deleted since the page was shown
                continue
            if changed:
                done += 1
                self.log_change(request, row, f"{verb} from the admin{note}.")
        text = f"{verb} {done} of {total} selected resource{'s' if total != 1 else ''}."
        if done < total:
            text += f" {total - done} {skipped}."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Release selected resources (whoever holds them)",
                  permissions=["change"])
    def release_selected(self, request, queryset):
        self._each(request, queryset, lambda p, n: p.release(n), "Released", "not held")

    @admin.action(description="Quarantine selected resources...", permissions=["change"])
    def quarantine_selected(self, request, queryset):
        """Ask for how long and why, then quarantine every slot of each resource."""
        form = QuarantineForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            seconds, reason = form.cleaned_data["duration"], form.cleaned_data["reason"]
            self._each(request, queryset, lambda p, n: p.quarantine(n, seconds, reason=reason), "Quarantined",
                       "gone", note=f" for {form.data['duration']}: {reason}")
            return None
        return TemplateResponse(request, "admin/leases/resource/quarantine.html", {
            **self.admin_site.each_context(request), "title": "Quarantine resources", "form": form,
            "resources": queryset.order_by("pool", "name").values_list("pool", "name").distinct(),
            "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME), "opts": self.model._meta,
        })

    @admin.action(description="Unquarantine selected resources", permissions=["change"])
    def unquarantine_selected(self, request, queryset):
        self._each(request, queryset, lambda p, n: p.unquarantine(n), "Unquarantined", "not quarantined")


class LockLive(PerRequest):
    """The lock columns."""

    def _held(self, obj: Lock) -> bool:
        return obj.held_at(request_now(self.request))

    @admin.display(description="state")
    def state(self, obj: Lock) -> str:
        state = "held" if self._held(obj) else "free"
        colour = _COLOURS[Resource.HELD if state == "held" else Resource.FREE]
        return format_html('<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
                           colour, state)

    @admin.display(description="owner", ordering="holder")
    def owner(self, obj: Lock) -> str:
        return _nowrap(obj.holder) if self._held(obj) else EMPTY

    @admin.display(description="expires in (s)", ordering="expires_at")
    def expires_in(self, obj: Lock) -> int | str:
        if not self._held(obj):
            return EMPTY
        return math.floor((obj.expires_at - request_now(self.request)).total_seconds())


@admin.register(Lock)
class LockAdmin(OnDatabase, admin.ModelAdmin):
    """Named locks: who holds them and for how long; breaking one goes through the engine."""

    search_fields = ("name", "holder")
    actions = ["break_selected"]
    fields = readonly_fields = ("name", "holder", "token", "expires", "acquired")

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def get_list_display(self, request):
        live = LockLive.of(request)
        return ("name", live.state, live.owner, live.expires_in, "token", "acquired")

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Lock) -> str | None:
        return compact_time(obj.acquired_at)

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: Lock) -> str | None:
        return None if obj.expires_at == EPOCH else compact_time(obj.expires_at)

    def has_add_permission(self, request) -> bool:
        return False  # locks are made by taking them

    @admin.action(description="Break selected locks (whoever holds them)", permissions=["change"])
    def break_selected(self, request, queryset):
        locks = list(queryset)
        broken = 0
        for lock in locks:
            if break_lock(lock.name, using=self.using):
                broken += 1
                self.log_change(request, lock, f"Broken from the admin (held by {lock.holder or 'nobody'}).")
        text = f"Broke {broken} of {len(locks)} selected lock{'s' if len(locks) != 1 else ''}."
        if broken < len(locks):
            text += f" {len(locks) - broken} not held."
        self.message_user(request, text, messages.SUCCESS if broken else messages.WARNING)
