"""Admin of per-key limits: operators' rules by prefix, and the keys that have been limited."""
from __future__ import annotations

from urllib.parse import urlencode

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import Count, IntegerField, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils.html import format_html

from leases.ops.adminkit import EMPTY, OnDatabase, compact_time

from ..jobs import limits
from ..models import Job, LimitKey, LimitRule
from .shared import ReadOnly


class LimitRuleForm(forms.ModelForm):
    class Meta:
        model = LimitRule
        fields = ("prefix", "concurrency", "rate")

    def clean(self):
        data = super().clean()
        try:
            limits.check_limit_key(data.get("prefix"))
            limits.check_concurrency(data.get("concurrency"))
            data["rate"] = limits.check_rate(data.get("rate") or "")
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if data.get("concurrency") is None and not data["rate"]:
            raise ValidationError("give a concurrency, a rate or both")
        return data


@admin.register(LimitRule)
class LimitRuleAdmin(OnDatabase, admin.ModelAdmin):
    """Limits for keys by prefix, without a deploy: every worker reads them within a second."""

    form = LimitRuleForm
    list_display = ("prefix", "concurrency", "rate", "updated")
    search_fields = ("^prefix",)

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def save_model(self, request, obj, form, change):
        obj.save(using=self.using)
        limits.forget_rules()

    def delete_model(self, request, obj):
        obj.delete(using=self.using)
        limits.forget_rules()

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: LimitRule) -> str | None:
        return compact_time(obj.updated_at)


def _jobs_of_key(status: int) -> Coalesce:
    jobs = Job.objects.filter(limit_key=OuterRef("name"), status=status).order_by().values("limit_key")
    return Coalesce(Subquery(jobs.annotate(n=Count("*")).values("n"), output_field=IntegerField()), 0)


@admin.register(LimitKey)
class LimitKeyAdmin(ReadOnly):
    """Keys that have been limited: how many of their jobs run, wait blocked or wait ready,
    and the limits in force (an operator's rule, else what the newest job carries).
    Counts read the (limit_key, status) index: one query per page."""

    search_fields = ("^name",)

    def get_queryset(self, request):
        newest = Job.objects.filter(limit_key=OuterRef("name")).order_by("-id")
        return super().get_queryset(request).annotate(
            n_running=_jobs_of_key(Job.RUNNING), n_blocked=_jobs_of_key(Job.BLOCKED),
            n_ready=_jobs_of_key(Job.READY),
            job_concurrency=Subquery(newest.values("concurrency")[:1]), job_rate=Subquery(newest.values("rate")[:1]),
        ).order_by("-n_blocked", "name")  # the keys holding most back first

    def get_list_display(self, request):
        return ("name", "running", "blocked", "ready", "concurrency", "rate", "at_limit")

    def _limits(self, obj: LimitKey) -> limits.Limits:
        return limits.limits_for(obj.name, obj.job_concurrency, obj.job_rate or "", self.using)

    @admin.display(description="running", ordering="n_running")
    def running(self, obj: LimitKey) -> int:
        return obj.n_running

    @admin.display(description="waiting blocked", ordering="n_blocked")
    def blocked(self, obj: LimitKey) -> str:
        url = self.admin_url("leases_tasks_job_changelist")
        return format_html('<a href="{}?{}">{}</a>', url,
                           urlencode({"limit_key": obj.name, "status__exact": Job.BLOCKED}), obj.n_blocked)

    @admin.display(description="waiting ready", ordering="n_ready")
    def ready(self, obj: LimitKey) -> int:
        return obj.n_ready

    @admin.display(description="concurrency")
    def concurrency(self, obj: LimitKey) -> str:
        found = self._limits(obj).concurrency
        return EMPTY if found is None else str(found)

    @admin.display(description="rate")
    def rate(self, obj: LimitKey) -> str:
        found = self._limits(obj)
        if found.starts is None:
            return EMPTY
        return f"{found.starts}/{ {1.0: 's', 60.0: 'm', 3600.0: 'h'}[found.period] }".replace(" ", "")

    @admin.display(description="at its limit", empty_value="")
    def at_limit(self, obj: LimitKey) -> str:
        """In words, and blank otherwise (not "-"): the admin's red cross for "not at its
        limit" read as "something is wrong"."""
        found = self._limits(obj)
        at = obj.n_blocked > 0 or (found.concurrency is not None and obj.n_running >= found.concurrency)
        return "at its limit" if at else ""
