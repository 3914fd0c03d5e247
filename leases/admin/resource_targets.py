"""Admin of what each target (a site) says of each resource: its bans, rests and pace, by
the database clock, and the action that lifts a ban and a rest.

Presentation only, as the resources' admin: a verdict changes through `leases.targets`
(`lift`), whose statements use the server clock, and every lift is recorded in the
history of the verdict and of its resource. Viewers of resources see the list; those who
may change resources lift. A ban's reason can quote what the site answered, URLs
included: viewers see it masked, as resource data.
"""
from __future__ import annotations

from datetime import datetime

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import OuterRef, Q, Subquery
from django.http import HttpRequest
from django.urls import NoReverseMatch
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from leases import targets
from leases.models import Resource, ResourceTarget
from leases.ops.adminkit import (
    EMPTY,
    CappedPaginator,
    OnDatabase,
    PerRequest,
    compact_time,
    local_time,
    may_change,
    request_now,
)
from leases.ops.masking import mask_text, sees_stored

#: Pools and targets the filters offer (any other works as ?pool=... or ?target=...).
LISTED = 50
#: Targets a resource's history names when its every target is lifted.
NAMED = 10
#: What can hold a resource for a target, each with the column of its end.
HOLDS = (("banned", "banned_until"), ("resting", "rested_until"), ("paced", "next_start_at"))


def in_force(row: ResourceTarget, now: datetime) -> list[tuple[str, datetime]]:
    """(what, until when) of each ban, rest or pace of `row` that has not ended at `now`."""
    return [(what, getattr(row, column)) for what, column in HOLDS
            if getattr(row, column) is not None and getattr(row, column) > now]


def verdicts(rows: list[ResourceTarget], now: datetime, masked: bool) -> SafeString:
    """A resource's verdicts, a line per target: "a.example: banned until ...: reason,
    resting until ...", or "nothing now" once every one has passed."""
    return format_html_join("", "<div>{}: {}</div>", ((row.target, holding(row, now, masked)) for row in rows))


def holding(row: ResourceTarget, now: datetime, masked: bool) -> SafeString | str:
    """What holds the resource for its target, each with its end and a ban with its reason."""
    parts = []
    for what, until in in_force(row, now):
        reason = row.ban_reason if what == "banned" else ""
        reason = mask_text(reason) if masked else reason
        parts.append(format_html("{} until {}{}", what, compact_time(until), f": {reason}" if reason else ""))
    return format_html_join(", ", "{}", ((part,) for part in parts)) if parts else "nothing now"


def lift_resource(pool: str, name: str, using: str, by: str) -> list[str] | bool:
    """Lift the bans and rests of resource `name` for every target, said `by` an admin
    user; the targets whose verdicts ended, or False when nothing was lifted."""
    return [target for _, target in targets.lift(pool, name, using=using, by=by)] or False


def admin_user(request: HttpRequest) -> str:
    """Who lifts, as the verdicts' log names an admin user."""
    return f"admin: {request.user.get_username()}"


def lifted_every_target(pool: str, name: str, held: list[str]) -> str:
    """The history line of a lift of every target's verdicts."""
    named = ", ".join(held[:NAMED]) + (f" and {len(held) - NAMED} more" if len(held) > NAMED else "")
    return f"Lifted the per-target bans and rests of {pool}/{name} from the admin" + (
        f" (every target: {named})." if named else " (every target).")


def may_view_resources(request: HttpRequest) -> bool:
    opts = Resource._meta
    return any(request.user.has_perm(f"{opts.app_label}.{get_permission_codename(action, opts)}")
               for action in ("view", "change"))


class PoolFilter(admin.SimpleListFilter):
    """Pools with verdicts, read through the (pool, name) index."""

    title = "pool"
    parameter_name = "pool"

    def lookups(self, request, model_admin):
        pools = ResourceTarget.objects.using(model_admin.using).order_by("pool").values_list("pool", flat=True)
        return [(pool, pool) for pool in pools.distinct()[:LISTED]]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(pool=self.value())


class TargetFilter(admin.SimpleListFilter):
    """Targets of the pool chosen (through the (pool, target, name) index), else those of
    the bans in force (through the index of bans): no index orders every target."""

    title = "target"
    parameter_name = "target"

    def lookups(self, request, model_admin):
        rows = ResourceTarget.objects.using(model_admin.using)
        if request.GET.get(PoolFilter.parameter_name):
            rows = rows.filter(pool=request.GET[PoolFilter.parameter_name])
        else:
            rows = rows.filter(banned_until__gt=request_now(request))
        found = rows.order_by("target").values_list("target", flat=True).distinct()[:LISTED]
        return [(target, target) for target in found]

    def has_output(self) -> bool:
        return True  # filter by a target given in the URL even when the list does not offer it

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(target=self.value())


class StateFilter(admin.SimpleListFilter):
    """What holds now, by the database clock: a ban, a rest, a pace, or nothing (passed)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return [("banned", "current bans"), ("resting", "current rests"), ("paced", "paced"),
                ("passed", "passed")]

    def queryset(self, request, queryset):
        if self.value() is None:
            return queryset
        now = request_now(request)
        ends = {what: Q(**{f"{column}__gt": now}) for what, column in HOLDS}
        if self.value() in ends:
            return queryset.filter(ends[self.value()])
        if self.value() == "passed":
            return queryset.exclude(ends["banned"] | ends["resting"] | ends["paced"])
        return queryset.none()


class VerdictLive(PerRequest):
    """The columns judged by the database clock."""

    @admin.display(description="holds")
    def holds(self, obj: ResourceTarget) -> str:
        found = in_force(obj, request_now(self.request))
        return ", ".join(what for what, _ in found) or "nothing now (passed)"

    @admin.display(description="until")
    def until(self, obj: ResourceTarget) -> str | SafeString:
        """When the target may use the resource again (the last end of what holds it);
        each end on hover."""
        found = in_force(obj, request_now(self.request))
        if not found:
            return EMPTY
        title = ", ".join(f"{what} until {local_time(until)}" for what, until in found)
        return format_html('<span title="{}">{}</span>', title, compact_time(max(until for _, until in found)))


@admin.register(ResourceTarget)
class ResourceTargetAdmin(OnDatabase, admin.ModelAdmin):
    """Per-target verdicts: pool, resource, target, what holds it and until when, why."""

    masked = ("ban_reason",)
    list_filter = (PoolFilter, TargetFilter, StateFilter)
    search_fields = ("name", "target")
    list_display_links = None
    actions = ("lift_selected",)
    show_full_result_count = False
    count_limit = 10000

    def get_queryset(self, request):
        """Each verdict with the page of its resource (its first slot's row, by the unique index)."""
        first = Resource.objects.filter(pool=OuterRef("pool"), name=OuterRef("name"), slot=0).values("pk")
        return super().get_queryset(request).using(self.using).annotate(resource_pk=Subquery(first[:1]))

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        return CappedPaginator(queryset, per_page, orphans, allow_empty_first_page, limit=self.count_limit)

    def get_list_display(self, request):
        live = VerdictLive.of(request)
        reason = "masked_reason" if self.masks(request, "ban_reason") else "reason"
        return ("resource", "pool", "target", live.holds, live.until, reason, "said")

    def get_fields(self, request, obj=None):
        """A verdict's page, read-only, its reason masked for viewers as in the list."""
        reason = "masked_reason" if self.masks(request, "ban_reason") else "ban_reason"
        return ("pool", "name", "target", "banned_until", reason, "rested_until", "next_start_at", "updated_at")

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    # -- who sees, who lifts: the resources' permissions ------------------------------------

    def sees_stored(self, request: HttpRequest) -> bool:
        return sees_stored(request.user, Resource._meta)

    def has_view_permission(self, request, obj=None) -> bool:
        return super().has_view_permission(request, obj) or may_view_resources(request)

    def has_add_permission(self, request) -> bool:
        return False  # verdicts are the targets' (leases.targets), made by jobs and spiders

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # changed only by the lift action, through leases.targets

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # a lift ends a verdict; `leases_prune` forgets those long passed

    def has_lift_permission(self, request) -> bool:
        return may_change(request, Resource._meta)

    # -- columns ------------------------------------------------------------------------

    @admin.display(description="resource", ordering="name")
    def resource(self, obj: ResourceTarget) -> str:
        """The resource's name, linked to its page (a resource since removed is not)."""
        if obj.resource_pk is None:
            return f"{obj.name} (removed)"
        try:
            url = self.admin_url("leases_resource_change", obj.resource_pk)
        except NoReverseMatch:  # a site without the resources' admin
            return obj.name
        return format_html('<a href="{}">{}</a>', url, obj.name)

    @admin.display(description="reason", ordering="ban_reason")
    def reason(self, obj: ResourceTarget) -> str:
        return obj.ban_reason or EMPTY

    @admin.display(description="reason")
    def masked_reason(self, obj: ResourceTarget) -> str:
        return mask_text(obj.ban_reason) or EMPTY

    @admin.display(description="said", ordering="updated_at")
    def said(self, obj: ResourceTarget) -> str | None:
        """When the target last said something of it."""
        return compact_time(obj.updated_at)

    # -- the action: through leases.targets ---------------------------------------------

    @admin.action(description="Lift selected verdicts (the resource's ban and rest for that target)",
                  permissions=["lift"])
    def lift_selected(self, request, queryset):
        rows = list(queryset.order_by("pool", "name", "target"))
        done = 0
        for row in rows:
            if not targets.lift(row.pool, row.name, row.target, using=self.using, by=admin_user(request)):
                continue
            done += 1
            message = f"Lifted the ban and rest of {row.pool}/{row.name} for target {row.target} from the admin."
            self.log_change(request, row, message)
            resource = Resource.objects.using(self.using).filter(pool=row.pool, name=row.name, slot=0).first()
            if resource is not None:
                self.log_change(request, resource, message)
        text = f"Lifted {done} of {len(rows)} selected verdict{'s' if len(rows) != 1 else ''}."
        if done < len(rows):
            text += f" {len(rows) - done} neither banned nor resting."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)
