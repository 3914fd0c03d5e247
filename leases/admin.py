"""Admin for resources: live lease state to look at, engine calls to change it.

Presentation only. Whether a resource is free, held or quarantined depends on the
database clock, so each request reads `db_now()` once and judges every row by that one
reading (never the web server's clock, which may be skewed from the one that decides
expiry). Lease state changes only through `Pool` methods, which use the server clock
and bump fencing tokens; the change form edits pool, name and data and nothing else.
"""
from __future__ import annotations

import json
import math
import re
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator

from . import db
from .exceptions import UnknownResource
from .locks import break_lock
from .models import Lock, Resource
from .pool import Pool, check_data, db_now

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
LEASE_STATE = (
    "busy_before",
    "holder",
    "token",
    "acquired_at",
    "renewed_at",
    "quarantined_until",
    "quarantine_reason",
)
_COLOURS = {Resource.FREE: "#2e9c4a", Resource.HELD: "#d08700", Resource.QUARANTINED: "#d3372c"}


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


def request_now(request: HttpRequest) -> datetime:
    """The database clock, read once per request: one instant for every row of the page."""
    try:
        return request._leases_now
    except AttributeError:
        request._leases_now = db_now(db.alias())
        return request._leases_now


class PerRequest:
    """Columns that depend on the database clock, bound to one request's reading of it.

    Display methods get the row but not the request, and a ModelAdmin is shared by
    concurrent requests, so the clock reading cannot live on the admin. Cached on the
    request: the form machinery matches these bound methods by equality across calls.
    """

    def __init__(self, request: HttpRequest) -> None:
        self.request = request

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
        state = self._state(obj)
        return format_html('<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
                           _COLOURS[state], state)

    @admin.display(description="holder", ordering="holder")
    def current_holder(self, obj: Resource) -> str:
        # The row keeps the last holder after expiry; it only means something while held.
        return _nowrap(obj.holder) if self._state(obj) == Resource.HELD else EMPTY

    @admin.display(description="expires in (s)", ordering="busy_before")
    def expires_in(self, obj: Resource) -> int | str:
        if self._state(obj) != Resource.HELD:
            return EMPTY
        return math.floor((obj.busy_before - request_now(self.request)).total_seconds())

    @admin.display(description="quarantined until", ordering="quarantined_until")
    def quarantine_until(self, obj: Resource) -> str:
        # A lapsed quarantine stays in the row until the next claim; it is history.
        return compact_time(obj.quarantined_until) if self._state(obj) == Resource.QUARANTINED else EMPTY

    @admin.display(description="quarantine reason")
    def reason(self, obj: Resource) -> str:
        return obj.quarantine_reason if self._state(obj) == Resource.QUARANTINED else EMPTY


class StateFilter(admin.SimpleListFilter):
    """Free, held or quarantined by the database clock, as SQL (same rules as state_at)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [(s, s) for s in (Resource.FREE, Resource.HELD, Resource.QUARANTINED)]

    def queryset(self, request, queryset):
        value = self.value()
        if value is None:
            return queryset
        now = request_now(request)
        if value == Resource.FREE:
            return queryset.filter(busy_before__lte=now)
        if value == Resource.HELD:
            return queryset.filter(busy_before__gt=now).exclude(quarantined_until__gt=now)
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


@admin.register(Resource)
class ResourceAdmin(admin.ModelAdmin):
    """Resources on the engine's database (settings.LEASES_DATABASE)."""

    form = ResourceForm
    list_filter = (StateFilter, "pool")
    search_fields = ("pool", "name", "holder")
    actions = ("release_selected", "quarantine_selected", "unquarantine_selected")

    # -- the engine's database --------------------------------------------------------

    @property
    def using(self) -> str:
        return db.alias()

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def save_model(self, request, obj, form, change):
        # A change saves only the edited fields: the row was read before a worker may
        # have claimed or renewed it, and writing back the stale lease columns (token,
        # busy_before, holder) would silently take the lease away or hand it back.
        fields = [f for f in form.changed_data if f in EDITABLE] if change else None
        obj.save(using=self.using, update_fields=fields)

    def delete_model(self, request, obj):
        obj.delete(using=self.using)

    # -- list -------------------------------------------------------------------------

    def get_list_display(self, request):
        live = Live.of(request)
        return (
            "name",
            "pool",
            live.state,
            live.current_holder,
            live.expires_in,
            "token",
            "acquired",
            "renewed",
            live.quarantine_until,
            live.reason,
            "data_preview",
        )

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Resource) -> str | None:
        return compact_time(obj.acquired_at)

    @admin.display(description="renewed", ordering="renewed_at")
    def renewed(self, obj: Resource) -> str | None:
        return compact_time(obj.renewed_at)

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
            return [(None, {"fields": EDITABLE})]
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

    def _each(self, request, queryset, call, verb: str, skipped: str) -> None:
        done = total = 0
        for pool, name in queryset.values_list("pool", "name"):
            total += 1
            try:
                done += call(Pool(pool, self.using), name) is not False
            except UnknownResource:  # deleted since the page was shown
                pass
        text = f"{verb} {done} of {total} selected resource{'s' if total != 1 else ''}."
        if done < total:
            text += f" {total - done} {skipped}."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Release selected resources (whoever holds them)",
                  permissions=["change"])
    def release_selected(self, request, queryset):
        self._each(request, queryset, lambda p, n: p.release(n), "Released", "not held")

    @admin.action(description="Quarantine selected resources for a day", permissions=["change"])
    def quarantine_selected(self, request, queryset):
        reason = f"quarantined from the admin by {request.user.get_username()}"
        self._each(request, queryset, lambda p, n: p.quarantine(n, 86400, reason=reason),
                   "Quarantined", "gone")

    @admin.action(description="Unquarantine selected resources", permissions=["change"])
    def unquarantine_selected(self, request, queryset):
        self._each(request, queryset, lambda p, n: p.unquarantine(n), "Unquarantined",
                   "not quarantined")


class LockLive(PerRequest):
    """The lock columns."""

    def _held(self, obj: Lock) -> bool:
        return obj.held_at(request_now(self.request))

    @admin.display(description="owner", ordering="holder")
    def owner(self, obj: Lock) -> str:
        return _nowrap(obj.holder) if self._held(obj) else EMPTY

    @admin.display(description="expires in (s)", ordering="expires_at")
    def expires_in(self, obj: Lock) -> int | str:
        if not self._held(obj):
            return EMPTY
        return math.floor((obj.expires_at - request_now(self.request)).total_seconds())


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):
    """Named locks: who holds them and for how long; breaking one goes through the engine."""

    search_fields = ("name", "holder")
    actions = ["break_selected"]
    readonly_fields = ("name", "holder", "token", "expires_at", "acquired_at")

    @property
    def using(self) -> str:
        return db.alias()

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def get_list_display(self, request):
        live = LockLive.of(request)
        return ("name", live.owner, live.expires_in, "token", "acquired")

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Lock) -> str | None:
        return compact_time(obj.acquired_at)

    def has_add_permission(self, request) -> bool:
        return False  # locks are made by taking them

    @admin.action(description="Break selected locks (whoever holds them)", permissions=["change"])
    def break_selected(self, request, queryset):
        names = list(queryset.values_list("name", flat=True))
        broken = sum(break_lock(name, using=self.using) for name in names)
        text = f"Broke {broken} of {len(names)} selected lock{'s' if len(names) != 1 else ''}."
        if broken < len(names):
            text += f" {len(names) - broken} not held."
        self.message_user(request, text, messages.SUCCESS if broken else messages.WARNING)
