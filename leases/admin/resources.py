"""Admin of resources: live lease state to look at, engine calls to change it.

Presentation only. Whether a resource is free, held or quarantined is judged by the
database clock, read once per request (`request_now`). Lease state changes only through
`Pool` methods, which use the server clock and bump fencing tokens; the change form
edits pool, name and data and nothing else.
"""
from __future__ import annotations

import json
import math
from datetime import datetime
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch
from django.utils.html import format_html
from django.utils.text import Truncator

from leases import targets
from leases.durations import parse_duration
from leases.exceptions import UnknownResource
from leases.lease import job_of
from leases.models import EPOCH, Resource
from leases.ops.adminkit import EMPTY, OnDatabase, PerRequest, compact_time, nowrap, request_now
from leases.ops.masking import mask_secrets
from leases.pool import Pool, check_data
from leases.validation import MAX_SLOTS

from .resource_targets import admin_user, lift_resource, lifted_every_target, verdicts

EDITABLE = ("pool", "name", "data")
LEASE_STATE = ("busy_until", "holder", "token", "acquired", "renewed", "quarantined", "quarantine_reason")
#: The colour of each state, in the resource and lock lists.
STATE_COLOURS = {Resource.FREE: "#2e9c4a", Resource.HELD: "#d08700", Resource.COOLING: "#4a7fd0",
                 Resource.QUARANTINED: "#d3372c"}


class Live(PerRequest):
    """The resource columns."""

    def _state(self, obj: Resource) -> str:
        return obj.state_at(request_now(self.request))

    @admin.display(description="state")
    def state(self, obj: Resource) -> str:
        """The state, and for a quarantined slot why and until when, in one cell."""
        state = self._state(obj)
        dot = format_html('<span style="color: {}">●</span> {}', STATE_COLOURS[state], state)
        if state == Resource.QUARANTINED:
            dot = format_html('{}: {} (until {})', dot, obj.quarantine_reason or "no reason given",
                              compact_time(obj.quarantined_until))
        return nowrap(dot)

    @admin.display(description="holder", ordering="holder")
    def current_holder(self, obj: Resource) -> str:
        # The row keeps the last holder after expiry; it only means something while held.
        return nowrap(obj.holder) if self._state(obj) == Resource.HELD else EMPTY

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

    @admin.display(description="held by")
    def held_by(self, obj: Resource) -> str:
        """The job whose attempt holds it (a job's lease names it in its holder), linked to
        its page where the job queue is installed; the holder otherwise."""
        if obj.state_at(request_now(self.request)) != Resource.HELD:
            return EMPTY
        found = job_of(obj.holder)
        if found is None:
            return obj.holder
        worker, job = found
        try:
            url = self.admin_url("leases_tasks_job_change", job)
        except NoReverseMatch:  # leases.tasks is not installed here
            return f"job #{job} on worker {worker}"
        return format_html('<a href="{}">job #{}</a> on worker {}', url, job, worker)

    @admin.display(description="targets")
    def per_target(self, obj: Resource) -> str:
        """A line per target that banned, rested or paced it, by the database clock, and a
        link to those verdicts in their own list."""
        rows = targets.of_resource(obj.pool, obj.name, self.using)
        if not rows:
            return "no target has said anything of it"
        masked = not self.request.leases_admin.sees_stored(self.request)  # a ban's reason can quote a URL
        shown = verdicts(rows, request_now(self.request), masked)
        try:
            url = self.admin_url("leases_resourcetarget_changelist")
        except NoReverseMatch:  # a site without the verdicts' admin
            return shown
        link = format_html('<a href="{}?{}">each target\'s verdict, to lift one</a>', url,
                           urlencode({"pool": obj.pool, "name": obj.name}))
        return format_html("{}<div>{}</div>", shown, link)


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

    masked = ("data",)
    form = ResourceForm
    list_filter = (StateFilter, "pool")
    search_fields = ("pool", "name", "holder")
    actions = ("release_selected", "quarantine_selected", "unquarantine_selected", "lift_selected")

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
        data = self.shown(request, "data")
        live = Live.of(request)
        lease = (live.state, live.expires_in, *LEASE_STATE)
        return [
            (None, {"fields": ("pool", "name", data)}),
            ("Lease state", {
                "fields": (*lease, live.held_by),
                "description": "Changed only through the actions of the resource list "
                               "(release, quarantine, unquarantine), by the database clock.",
            }),
            ("Per target", {
                "fields": (live.per_target,),
                "description": "What each target (a site) says of this resource: bans and rests keep it from "
                               "that target only. Lift every target's with the resource list's action, or one "
                               "target's in the list of verdicts.",
            }),
        ]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        live = Live.of(request)
        return (*LEASE_STATE, live.state, live.expires_in, "masked_data", live.held_by, live.per_target)

    @admin.display(description="data")
    def masked_data(self, obj: Resource) -> str:
        text = json.dumps(mask_secrets(obj.data), ensure_ascii=False, indent=2, sort_keys=True)
        return format_html('<pre style="margin: 0">{}</pre>', text)

    # -- actions: through the engine ----------------------------------------------------

    def _each(self, request, queryset, call, verb: str, skipped: str, note: str = "", history=None) -> None:
        """Apply `call(pool, name)` to each selected resource (every slot of it) through the
        engine, and record it in each row's history: "<verb> from the admin<note>.", or
        `history(row, what call returned)`."""
        done = total = 0
        seen = set()
        for row in queryset.order_by("pool", "name", "slot"):
            if (row.pool, row.name) in seen:
                continue  # one call acts on every slot of the resource
            seen.add((row.pool, row.name))
            total += 1
            try:
                result = call(Pool(row.pool, self.using), row.name)
            except UnknownResource:  # deleted since the page was shown
                continue
            if result is not False:
                done += 1
                self.log_change(request, row, history(row, result) if history else f"{verb} from the admin{note}.")
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

    @admin.action(description="Lift selected resources' per-target bans and rests", permissions=["change"])
    def lift_selected(self, request, queryset):
        """Every target's bans and rests of each resource, each lift named in its history."""
        self._each(request, queryset, lambda p, n: lift_resource(p.name, n, p.using, admin_user(request)),
                   "Lifted the per-target bans and rests of", "neither banned nor rested by any target",
                   history=lambda row, held: lifted_every_target(row.pool, row.name, held))
