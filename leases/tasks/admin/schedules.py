"""Admin of schedules: what, when, how the last runs ended, by the database clock.

Saved through `schedules.schedule()`, so the form checks what the API checks and a
changed timing starts again from the database clock. Rows from LEASES_SCHEDULES are
shown read-only: the settings are their source, and a worker's start would undo an edit.
"""
from __future__ import annotations

from datetime import datetime

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import OuterRef, Subquery
from django.utils.html import format_html

from leases.management.text import elapsed
from leases.ops.adminkit import (
    EMPTY,
    OnDatabase,
    OnDatabaseInline,
    PerRequest,
    compact_time,
    pretty_json,
    request_now,
)
from leases.ops.masking import mask_secrets, mask_text

from .. import schedules
from ..models import Schedule, ScheduleRun
from .shared import relative


class ScheduleForm(forms.ModelForm):
    class Meta:
        model = Schedule
        fields = ("name", "handler", "pipeline", "cron", "every", "at", "timezone", "payload", "queue",
                  "priority", "enabled", "catch_up")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if "timezone" in self.fields:
            self.fields["timezone"].required = False
            self.fields["timezone"].help_text = f"Of the cron expression; blank: {settings.TIME_ZONE}."

    def clean(self):
        data = super().clean()
        data.setdefault("name", self.instance.name)  # read-only once made
        target = {"payload": data.get("payload")} if data.get("handler") else {"context": data.get("payload")}
        try:
            schedules.check(
                data.get("name") or "", data.get("handler") or None, pipeline=data.get("pipeline") or None,
                cron=data.get("cron") or None, every=data.get("every"), at=data.get("at"),
                timezone=data.get("timezone") or None, queue=data.get("queue") or None,
                priority=data.get("priority") or 0, enabled=bool(data.get("enabled")),
                catch_up=data.get("catch_up") or Schedule.LAST, now=request_now_or_none(self), **target,
            )
        except (ValueError, LookupError) as exc:
            raise ValidationError(str(exc)) from None
        return data


def request_now_or_none(form: forms.Form) -> datetime | None:
    """The database clock the admin read for this request, when the form has it."""
    request = getattr(form, "request", None)
    return request_now(request) if request is not None else None


class ScheduleLive(PerRequest):
    """The schedule columns that depend on the database clock and on the latest run."""

    @admin.display(description="next fire", ordering="next_fire_at")
    def next_fire(self, obj: Schedule) -> str:
        return relative(obj.next_fire_at, request_now(self.request)) if obj.enabled else EMPTY

    @admin.display(description="last fire", ordering="last_fire_at")
    def last_fire(self, obj: Schedule) -> str:
        return relative(obj.last_fire_at, request_now(self.request))


class ScheduleRunInline(OnDatabaseInline, admin.TabularInline):
    """The newest runs (LEASES_KEEP_RUNS are kept): tick, job, how it ended."""

    model = ScheduleRun
    extra = 0
    can_delete = False
    ordering = ("-number",)

    def get_fields(self, request, obj=None):
        """Errors quote payloads, URLs and headers, credentials included: as stored only to
        those who may change the schedule, masked for viewers (as a job's errors are)."""
        error = "masked_error" if request.leases_admin.masks(request, "runs__error") else "error"
        return ("number", "tick", "fired", "job", "status", "duration", error)

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="tick")
    def tick(self, obj: ScheduleRun) -> str:
        return compact_time(obj.tick_at) or "by hand"

    @admin.display(description="fired")
    def fired(self, obj: ScheduleRun) -> str | None:
        return compact_time(obj.fired_at)

    @admin.display(description="job")
    def job(self, obj: ScheduleRun) -> str:
        if not obj.job_id:
            return EMPTY
        return format_html('<a href="{}">#{}</a>', self.admin_url("leases_tasks_job_change", obj.job_id),
                           obj.job_id)

    @admin.display(description="duration")
    def duration(self, obj: ScheduleRun) -> str:
        return elapsed(obj.started_at, obj.finished_at, None) or EMPTY

    @admin.display(description="error")
    def masked_error(self, obj: ScheduleRun) -> str:
        return mask_text(obj.error)


class LastStatus(admin.SimpleListFilter):
    """Schedules whose newest run ended this way."""

    title = "last run"
    parameter_name = "last"

    def lookups(self, request, model_admin):
        return [(s, s) for s in ("succeeded", "failed", "dead", "cancelled", "discarded", "queued")]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(last_status=self.value())


@admin.register(Schedule)
class ScheduleAdmin(OnDatabase, admin.ModelAdmin):
    """Schedules: what, when (a cron in words), next and last fire by the database clock,
    how the last run ended, and the newest runs; enable, disable and run now go through
    `leases.tasks.schedules`, and each is recorded in the admin's history."""

    #: Shown as stored to those who may change schedules, masked for viewers: payloads
    #: carry credentials to the jobs they make, and errors quote them.
    masked = ("payload", "runs__error")
    form = ScheduleForm
    list_filter = ("enabled", "source", LastStatus)
    search_fields = ("^name", "^handler", "^pipeline")
    inlines = (ScheduleRunInline,)
    actions = ("enable_selected", "disable_selected", "run_selected")

    def get_queryset(self, request):
        newest = ScheduleRun.objects.filter(schedule=OuterRef("pk")).order_by("-number").values("status")
        return super().get_queryset(request).using(self.using).annotate(last_status=Subquery(newest[:1]))

    def get_list_display(self, request):
        live = ScheduleLive.of(request)
        return ("name", "what", "when", live.next_fire, live.last_fire, "last_run", "enabled", "source")

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change, **kwargs)
        form.request = request
        return form

    def get_fieldsets(self, request, obj=None):
        """Who may change the schedule edits the payload as stored; viewers see it masked
        (as a job's), since payloads carry credentials to the jobs they make."""
        payload = "payload" if obj is None else self.shown(request, "payload")
        what = ("name", "handler", "pipeline", payload, "queue", "priority")
        when = ("cron", "every", "at", "timezone", "catch_up", "enabled")
        fieldsets = [
            (None, {"fields": what, "description": "A handler's job with the payload, or a pipeline's run with "
                                                   "the payload as its context."}),
            ("When", {"fields": when, "description": "One of cron (in the time zone), every (seconds) and at."}),
        ]
        if obj is not None:
            live = ScheduleLive.of(request)
            fieldsets.append(("State (database clock)", {"fields": ("when", live.next_fire, live.last_fire, "fires",
                                                                     "source")}))
        return fieldsets

    def get_readonly_fields(self, request, obj=None):
        live = ScheduleLive.of(request)
        state = ("when", live.next_fire, live.last_fire, "fires", "source")
        if obj is not None and obj.source == Schedule.SETTINGS:
            return (*ScheduleForm.Meta.fields, *state)
        return ("name", *state) if obj is not None else ()

    def has_delete_permission(self, request, obj=None) -> bool:
        if obj is not None and obj.source == Schedule.SETTINGS:
            return False
        return super().has_delete_permission(request, obj)

    def save_model(self, request, obj, form, change):
        """Through schedule(): the next tick by the database clock, history kept."""
        data = form.cleaned_data
        target = {"payload": data["payload"]} if data["handler"] else {"context": data["payload"]}
        saved = schedules.schedule(
            data["name"], data["handler"] or None, pipeline=data["pipeline"] or None, cron=data["cron"] or None,
            every=data["every"], at=data["at"], timezone=data["timezone"] or None, queue=data["queue"] or None,
            priority=data["priority"], enabled=data["enabled"], catch_up=data["catch_up"], using=self.using,
            **target,
        )
        obj.pk = saved.pk

    def delete_model(self, request, obj):
        schedules.unschedule(obj.name, using=self.using)

    @admin.display(description="payload")
    def masked_payload(self, obj: Schedule) -> str:
        return pretty_json(mask_secrets(obj.payload))

    @admin.display(description="what")
    def what(self, obj: Schedule) -> str:
        return obj.handler or f"pipeline {obj.pipeline}"

    @admin.display(description="when")
    def when(self, obj: Schedule) -> str:
        return schedules.Timing.of(obj).describe()

    @admin.display(description="last run", ordering="last_status")
    def last_run(self, obj: Schedule) -> str:
        return obj.last_status or EMPTY

    # -- actions: through leases.tasks.schedules ---------------------------------------

    def _each(self, request, queryset, verb: str, call) -> None:
        rows = list(queryset.only("pk", "name"))
        done = 0
        for row in rows:
            if call(row.name) is not False:
                done += 1
                self.log_change(request, row, f"{verb.capitalize()} from the admin.")
        text = f"{verb.capitalize()}: {done} of {len(rows)} selected schedule{'s' if len(rows) != 1 else ''}."
        if done < len(rows):
            text += f" {len(rows) - done} already were."
        self.message_user(request, text, messages.SUCCESS if done else messages.INFO)

    @admin.action(description="Enable selected schedules (next tick from now)", permissions=["change"])
    def enable_selected(self, request, queryset):
        self._each(request, queryset, "enable", lambda name: schedules.set_enabled(name, True, using=self.using))

    @admin.action(description="Disable selected schedules", permissions=["change"])
    def disable_selected(self, request, queryset):
        self._each(request, queryset, "disable", lambda name: schedules.set_enabled(name, False, using=self.using))

    @admin.action(description="Run selected schedules now (outside their ticks)", permissions=["change"])
    def run_selected(self, request, queryset):
        self._each(request, queryset, "run", lambda name: schedules.fire_now(name, using=self.using))
