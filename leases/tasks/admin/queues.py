"""Admin of the job queue's queues and of its workers (`leases_worker` processes).

Only queue settings are edited (a changed one reaches every process within
queues.SETTINGS_TTL); workers change only through their own fenced statements, so they
are shown read-only. Every page reads the database clock once.
"""
from __future__ import annotations

import math
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Count, IntegerField, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils.html import format_html, format_html_join

from leases.ops.adminkit import EMPTY, OnDatabase, PerRequest, compact_time, local_time, request_now
from leases.validation import check_queue

from ..jobs import handoff, queues
from ..models import Job, Queue, Worker
from .jobs import ALL, KindFilter
from .shared import ReadOnly, relative


def _jobs_of_queue(status: int) -> Coalesce:
    jobs = Job.objects.filter(queue=OuterRef("name"), status=status).values("queue")
    return Coalesce(Subquery(jobs.annotate(n=Count("*")).values("n"), output_field=IntegerField()), 0)


class QueueForm(forms.ModelForm):
    def clean_name(self) -> str:
        try:
            return check_queue(self.cleaned_data["name"])
        except ValueError as exc:
            raise ValidationError(str(exc)) from None

    def clean_full_timeout(self) -> float:
        value = self.cleaned_data["full_timeout"]
        if not 0 <= value < math.inf:
            raise ValidationError("full_timeout must be a number of seconds >= 0")
        return value


class QueueLive(PerRequest):
    @admin.display(description="oldest due", ordering="oldest_ready")
    def oldest_due(self, obj: Queue) -> str:
        """How long the longest-waiting due job has been due; '-' when none is due."""
        now = request_now(self.request)
        if obj.oldest_ready is None or obj.oldest_ready > now:
            return EMPTY
        return relative(obj.oldest_ready, now)


@admin.register(Queue)
class QueueAdmin(OnDatabase, admin.ModelAdmin):
    """Queues: their backlog and settings. Counts are subqueries over the claim index, one
    query per page. Rows are made on first push and kept (deleting one would drop a pause),
    and a changed setting reaches every process within queues.SETTINGS_TTL."""

    form = QueueForm
    fields = ("name", "paused", "max_length", "when_full", "full_timeout")
    list_filter = ("paused",)
    search_fields = ("name",)
    actions = ("pause_selected", "resume_selected")

    def get_queryset(self, request):
        due = Job.objects.filter(queue=OuterRef("name"), status=Job.READY).order_by("run_at").values("run_at")
        return super().get_queryset(request).using(self.using).annotate(
            n_waiting=_jobs_of_queue(Job.READY),
            n_running=_jobs_of_queue(Job.RUNNING),
            oldest_ready=Subquery(due[:1]),
        )

    def get_list_display(self, request):
        return ("name", "state", "waiting", QueueLive.of(request).oldest_due, "running", "max_length", "when_full")

    @admin.display(description="state", ordering="paused")
    def state(self, obj: Queue) -> str:
        """Active or paused in words (a green tick for "paused" read as "fine")."""
        colour, word = ("#d3372c", "paused") if obj.paused else ("#2e9c4a", "active")
        return format_html('<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
                           colour, word)

    def get_readonly_fields(self, request, obj=None):
        return ("name",) if obj is not None else ()  # jobs name their queue: renaming would orphan them

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        obj.save(using=self.using)
        queues.forget_settings()

    def _link(self, obj: Queue, count: int, status: int) -> str:
        url = self.admin_url("leases_tasks_job_changelist")
        # Of every kind, as counted: internal jobs (a pipeline's events) wait in queues too.
        query = urlencode({"queue": obj.name, "status__exact": status, KindFilter.parameter_name: ALL})
        return format_html('<a href="{}?{}">{}</a>', url, query, count)

    @admin.display(description="waiting", ordering="n_waiting")
    def waiting(self, obj: Queue) -> str:
        return self._link(obj, obj.n_waiting, Job.READY)

    @admin.display(description="running", ordering="n_running")
    def running(self, obj: Queue) -> str:
        return self._link(obj, obj.n_running, Job.RUNNING)

    def _set_paused(self, request, queryset, paused: bool) -> None:
        verb = "Paused" if paused else "Resumed"
        rows = list(queryset.exclude(paused=paused))
        changed = queryset.filter(pk__in=[row.pk for row in rows]).update(paused=paused)
        for row in rows:
            self.log_change(request, row, f"{verb} from the admin.")
        queues.forget_settings()
        self.message_user(request, f"{verb} {changed} queue{'s' if changed != 1 else ''}.",
                          messages.SUCCESS if changed else messages.INFO)

    @admin.action(description="Pause selected queues (workers claim nothing from them)",
                  permissions=["change"])
    def pause_selected(self, request, queryset):
        self._set_paused(request, queryset, True)

    @admin.action(description="Resume selected queues", permissions=["change"])
    def resume_selected(self, request, queryset):
        self._set_paused(request, queryset, False)


class QueueWorkerLive(PerRequest):
    """The worker columns: liveness by the database clock, and the jobs each one runs.

    The running jobs of a whole page are read with one query (`load`), before the rows
    are shown; a single worker's page loads its own.
    """

    def __init__(self, request) -> None:
        super().__init__(request)
        self.jobs: dict[str, list[tuple[int, str]]] = {}

    def load(self, names: list[str]) -> None:
        for name in names:
            self.jobs.setdefault(name, [])
        rows = Job.objects.using(self.using).filter(status=Job.RUNNING, worker__in=names)
        for worker, pk, name in rows.order_by("id").values_list("worker", "id", "name"):
            self.jobs[worker].append((pk, name))

    @admin.display(description="state", ordering="expires_at")
    def state(self, obj: Worker) -> str:
        if obj.expires_at > request_now(self.request):
            return "alive"
        return "stopped" if not obj.holder else "lapsed"  # stopping releases the row

    @admin.display(description="last heartbeat", ordering="heartbeat_at")
    def heartbeat(self, obj: Worker) -> str:
        return relative(obj.heartbeat_at, request_now(self.request))

    @admin.display(description="running")
    def running(self, obj: Worker) -> str:
        if obj.name not in self.jobs:
            self.load([obj.name])
        url = self.admin_url("leases_tasks_job_changelist")
        links = [format_html('<a href="{}{}/change/">{} #{}</a>', url, pk, name, pk)
                 for pk, name in self.jobs[obj.name]]
        return format_html_join(", ", "{}", ((link,) for link in links)) or EMPTY


@admin.register(Worker)
class QueueWorkerAdmin(ReadOnly):
    """`leases_worker` processes: alive while their lease is, and the jobs they run."""

    search_fields = ("name",)
    fields = ("name", "queues", "concurrency", "handler_names", "started", "heartbeat", "expires")

    def get_list_display(self, request):
        live = QueueWorkerLive.of(request)
        return ("name", "queues", "concurrency", "started", live.heartbeat, live.state, live.running)

    def get_fields(self, request, obj=None):
        live = QueueWorkerLive.of(request)
        return (*self.fields, live.state, live.running)

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        # Evaluates the page (the template reuses it) and reads its running jobs at once.
        QueueWorkerLive.of(request).load([w.name for w in changelist.result_list])
        return changelist

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Worker) -> str | None:
        return compact_time(obj.started_at)

    @admin.display(description="heartbeat")
    def heartbeat(self, obj: Worker) -> str:
        return local_time(obj.heartbeat_at)

    @admin.display(description="lease expires")
    def expires(self, obj: Worker) -> str:
        return local_time(obj.expires_at)

    @admin.display(description="handlers")
    def handler_names(self, obj: Worker) -> str:
        """The handlers it can run (a job whose handler it lacks goes to one that has it)."""
        return ", ".join(handoff.names(obj.handlers)) or EMPTY
