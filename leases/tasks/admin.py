"""Admin for the work dispatcher and the job queue: state to look at, the engine to act.

Presentation only. Pools are rebuilt through `Dispatcher.recreate_task_pool` (the API or
the `dispatch` command) and tasks move only through the dispatcher's statements, so
nothing of the dispatcher can be added, edited or deleted; the one action calls
`Dispatcher.reclaim()`. The models join on the dispatcher's name (no foreign keys), so
the counts are correlated subqueries: one query per page, however many rows it shows.
The job queue's part (jobs, queues, queue workers) follows the same rules; see below.
"""
from __future__ import annotations

import json
import math
from datetime import datetime
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Count, IntegerField, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.urls import reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join

from leases import db
from leases.admin import EMPTY, PerRequest, _nowrap, compact_time, mask_secrets, mask_text, request_now

from . import queue, registry
from .dispatcher import Dispatcher
from .models import DispatchWorker, Job, JobError, PoolTask, Queue, TaskPool, Worker


def may_change(request, opts) -> bool:
    """Whether the user holds the model's change permission, which the actions require
    where the forms are read-only."""
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename('change', opts)}")


def _count(queryset) -> Coalesce:
    """COUNT(*) of `queryset` as a column of the outer query (0 when nothing matches)."""
    counted = queryset.values("dispatcher").annotate(n=Count("*")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def _tasks_of_dispatcher(state: int) -> Coalesce:
    return _count(PoolTask.objects.filter(dispatcher=OuterRef("name"), state=state))


class ReadOnly(admin.ModelAdmin):
    """Rows of the engine's database (settings.LEASES_DATABASE), to look at only."""

    @property
    def using(self) -> str:
        return db.alias()

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(TaskPool)
class TaskPoolAdmin(ReadOnly):
    """Dispatchers: where their tasks are, and the reclaim of stale workers' buckets."""

    list_display = ("name", "pool_size", "assigned", "done", "workers", "generation", "rebuilt")
    fields = ("name", "pool_size", "assigned", "done", "workers", "generation", "rebuild_started_at",
              "rebuilt_at")
    readonly_fields = fields
    search_fields = ("name",)
    actions = ("reclaim_selected",)

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(
            n_pool=_tasks_of_dispatcher(PoolTask.POOL),
            n_assigned=_tasks_of_dispatcher(PoolTask.BUCKET),
            n_done=_tasks_of_dispatcher(PoolTask.DONE),
            n_workers=_count(DispatchWorker.objects.filter(dispatcher=OuterRef("name"))),
        )

    @admin.display(description="pool size", ordering="n_pool")
    def pool_size(self, obj: TaskPool) -> int:
        return obj.n_pool

    @admin.display(description="assigned", ordering="n_assigned")
    def assigned(self, obj: TaskPool) -> int:
        return obj.n_assigned

    @admin.display(description="done", ordering="n_done")
    def done(self, obj: TaskPool) -> int:
        return obj.n_done

    @admin.display(description="workers", ordering="n_workers")
    def workers(self, obj: TaskPool) -> int:
        return obj.n_workers

    @admin.display(description="rebuilt", ordering="rebuilt_at")
    def rebuilt(self, obj: TaskPool) -> str | None:
        return compact_time(obj.rebuilt_at)

    def has_reclaim_permission(self, request) -> bool:
        """Reclaiming moves tasks, so it takes the change permission the forms do not use."""
        return may_change(request, self.opts)

    @admin.action(description="Reclaim buckets of stale workers now", permissions=["reclaim"])
    def reclaim_selected(self, request, queryset):
        """What `assign_tasks` does every stale_after/4 seconds, for when no worker calls it."""
        names = list(queryset.values_list("name", flat=True))
        returned = sum(Dispatcher(name, using=self.using).reclaim() for name in names)
        self.message_user(
            request,
            f"{returned} task{'s' if returned != 1 else ''} of stale workers back in the pool"
            f" of {len(names)} dispatcher{'s' if len(names) != 1 else ''}.",
            messages.SUCCESS if returned else messages.INFO,
        )


class WorkerLive(PerRequest):
    """The worker column that depends on the database clock."""

    @admin.display(description="seen (s ago)", ordering="-last_seen")
    def seen_ago(self, obj: DispatchWorker) -> int | str:
        return math.floor((request_now(self.request) - obj.last_seen).total_seconds())


@admin.register(DispatchWorker)
class DispatchWorkerAdmin(ReadOnly):
    """Workers and the size of their buckets; a stale worker's bucket is reclaimed by its dispatcher."""

    list_filter = ("dispatcher",)
    search_fields = ("name",)

    def get_queryset(self, request):
        bucket = PoolTask.objects.filter(
            dispatcher=OuterRef("dispatcher"), worker=OuterRef("name"), state=PoolTask.BUCKET
        )
        return super().get_queryset(request).annotate(n_bucket=_count(bucket))

    def get_list_display(self, request):
        return ("name", "dispatcher", "bucket_size", "last_seen_at", WorkerLive.of(request).seen_ago)

    @admin.display(description="bucket size", ordering="n_bucket")
    def bucket_size(self, obj: DispatchWorker) -> int:
        return obj.n_bucket

    @admin.display(description="last seen", ordering="last_seen")
    def last_seen_at(self, obj: DispatchWorker) -> str | None:
        return compact_time(obj.last_seen)


class DispatcherFilter(admin.SimpleListFilter):
    """Dispatchers by the small TaskPool table, not a DISTINCT over every task row."""

    title = "dispatcher"
    parameter_name = "dispatcher"

    def lookups(self, request, model_admin):
        names = TaskPool.objects.using(model_admin.using).values_list("name", flat=True)
        return [(name, name) for name in names]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(dispatcher=self.value())


@admin.register(PoolTask)
class PoolTaskAdmin(ReadOnly):
    """Tasks, made to stay quick on a table of millions of rows.

    The default order is the claim index's, so a page is one index range (with a
    dispatcher and state chosen, the next tasks to be handed out come first), and the
    unfiltered total is not counted a second time. Search is by prefix of the task id.
    """

    list_display = ("value", "dispatcher", "score", "state", "worker", "assigned", "done")
    list_filter = (DispatcherFilter, "state")
    search_fields = ("^value",)
    ordering = ("dispatcher", "state", "score", "id")
    show_full_result_count = False

    @admin.display(description="assigned", ordering="assigned_at")
    def assigned(self, obj: PoolTask) -> str | None:
        return compact_time(obj.assigned_at)

    @admin.display(description="done", ordering="done_at")
    def done(self, obj: PoolTask) -> str | None:
        return compact_time(obj.done_at)


# -- the job queue ----------------------------------------------------------------------
#
# Jobs, queues and workers change only through `leases.tasks.queue` (the operator
# actions) and the workers' fenced statements: a form saving a whole Job row it read a
# moment ago could undo a claim or an outcome, so jobs and workers are shown read-only.
# Only queue settings are edited; every page reads the database clock once.

#: Ids per engine call, well under the placeholder limits of MySQL and SQLite.
ACTION_BATCH = 500


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def relative(moment: datetime | None, now: datetime) -> str:
    """'in 3s' or '12s ago' by the database clock; the exact time on hover."""
    if moment is None:
        return EMPTY
    delta = (moment - now).total_seconds()
    text = f"in {_duration(delta)}" if delta > 0 else f"{_duration(-delta)} ago"
    return format_html('<span style="white-space: nowrap" title="{}">{}</span>',
                       timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S"), text)


def _pre(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)
    return format_html('<pre style="margin: 0">{}</pre>', text)


def _folded(text: str) -> str:
    """A traceback behind a "show" toggle, so the errors table stays one line per attempt."""
    if not text:
        return EMPTY
    return format_html('<details><summary>show</summary><pre style="margin: 0">{}</pre></details>', text)


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


class QueueFilter(admin.SimpleListFilter):
    """Queues by the small Queue table, not a DISTINCT over every job."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request, model_admin):
        return [(n, n) for n in Queue.objects.using(model_admin.using).values_list("name", flat=True)]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(queue=self.value())


class NameFilter(admin.SimpleListFilter):
    """Handlers registered in this process; any other name works as ?name=... in the URL."""

    title = "name"
    parameter_name = "name"

    def lookups(self, request, model_admin):
        return [(n, n) for n in sorted(registry.registered())]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(name=self.value())


class JobLive(PerRequest):
    """The job columns that depend on the database clock."""

    @admin.display(description="status", ordering="status")
    def status_text(self, obj: Job) -> str:
        if obj.status == Job.READY and obj.attempt:
            return _nowrap("awaiting retry")
        if obj.status == Job.RUNNING and obj.expires_at and obj.expires_at <= request_now(self.request):
            return _nowrap("running, lease lapsed")  # its worker is gone; recovery will requeue it
        return obj.get_status_display()

    @admin.display(description="run at", ordering="run_at")
    def run_in(self, obj: Job) -> str:
        return relative(obj.run_at, request_now(self.request))


class JobErrorInline(admin.TabularInline):
    """What each failed attempt raised, oldest first."""

    model = JobError
    extra = 0
    can_delete = False

    def get_queryset(self, request):
        return super().get_queryset(request).using(db.alias())

    def get_fields(self, request, obj=None):
        """Messages and tracebacks quote arguments, URLs and headers, credentials included:
        as the payload, they are shown as stored only to those who may act on the job."""
        if may_change(request, self.parent_model._meta):
            return ("attempt", "exception", "message", "trace", "worker", "at")
        return ("attempt", "exception", "masked_message", "masked_trace", "worker", "at")

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="message")
    def masked_message(self, obj: JobError) -> str:
        return mask_text(obj.message)

    @admin.display(description="traceback")
    def trace(self, obj: JobError) -> str:
        return _folded(obj.traceback)

    @admin.display(description="traceback")
    def masked_trace(self, obj: JobError) -> str:
        return _folded(mask_text(obj.traceback))


@admin.register(Job)
class JobAdmin(ReadOnly):
    """Jobs, quick on a table of a million finished rows: newest first by primary key,
    filters that read no job rows, and a count that stops at `count_limit`."""

    list_filter = (QueueFilter, "status", NameFilter)
    ordering = ("-id",)
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    count_limit = 10000
    inlines = (JobErrorInline,)
    actions = ("retry_selected", "cancel_selected", "discard_selected")

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        return CappedPaginator(queryset, per_page, orphans, allow_empty_first_page, limit=self.count_limit)

    def get_list_display(self, request):
        live = JobLive.of(request)
        return ("id", "name", "queue", live.status_text, "priority", "attempts", live.run_in, "worker",
                "finished")

    def get_fieldsets(self, request, obj=None):
        """Who may act on jobs sees payload and result as stored; viewers see them masked
        (as resource data), since handlers take and return credentials too."""
        live = JobLive.of(request)
        if may_change(request, self.opts):
            shown = ("payload_json", "result_json")
        else:
            shown = ("masked_payload", "masked_result")
        return [
            (None, {"fields": ("name", "queue", "backend", live.status_text, "priority", "attempts",
                               live.run_in, "run_at", "worker", "expires_at", "enqueued_at", "started_at",
                               "finished_at", "key", "pending_key")}),
            ("Payload and result", {"fields": shown}),
        ]

    @admin.display(description="attempts")
    def attempts(self, obj: Job) -> str:
        return f"{obj.attempt}/{obj.max_attempts}"

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Job) -> str | None:
        return compact_time(obj.finished_at)

    @admin.display(description="payload")
    def payload_json(self, obj: Job) -> str:
        return _pre(obj.payload)

    @admin.display(description="payload")
    def masked_payload(self, obj: Job) -> str:
        return _pre(mask_secrets(obj.payload))

    @admin.display(description="result")
    def result_json(self, obj: Job) -> str:
        return EMPTY if obj.result is None else _pre(obj.result)

    @admin.display(description="result")
    def masked_result(self, obj: Job) -> str:
        return EMPTY if obj.result is None else _pre(mask_secrets(obj.result))

    # -- actions: through leases.tasks.queue ------------------------------------------------

    def has_operate_permission(self, request) -> bool:
        return may_change(request, self.opts)

    def _apply(self, request, queryset, call, verb: str, skipped: str) -> None:
        ids = list(queryset.values_list("id", flat=True))
        batches = (ids[i : i + ACTION_BATCH] for i in range(0, len(ids), ACTION_BATCH))
        done = sum(call(batch, using=self.using) for batch in batches)
        text = f"{verb} {done} of {len(ids)} selected job{'s' if len(ids) != 1 else ''}."
        if done < len(ids):
            text += f" {len(ids) - done} {skipped}."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Retry selected failed, dead or cancelled jobs now", permissions=["operate"])
    def retry_selected(self, request, queryset):
        self._apply(request, queryset, queue.retry, "Retried", "not failed, dead or cancelled")

    @admin.action(description="Cancel selected waiting jobs", permissions=["operate"])
    def cancel_selected(self, request, queryset):
        self._apply(request, queryset, queue.cancel, "Cancelled", "not waiting")

    @admin.action(description="Discard selected jobs that are not running", permissions=["operate"])
    def discard_selected(self, request, queryset):
        self._apply(request, queryset, queue.discard, "Discarded", "running")


def _jobs_of_queue(status: int) -> Coalesce:
    jobs = Job.objects.filter(queue=OuterRef("name"), status=status).values("queue")
    return Coalesce(Subquery(jobs.annotate(n=Count("*")).values("n"), output_field=IntegerField()), 0)


class QueueForm(forms.ModelForm):
    def clean_name(self) -> str:
        try:
            return queue.check_queue(self.cleaned_data["name"])
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
class QueueAdmin(admin.ModelAdmin):
    """Queues: their backlog and settings. Counts are subqueries over the claim index, one
    query per page. Rows are made on first push and kept (deleting one would drop a pause),
    and a changed setting reaches every process within queue.SETTINGS_TTL."""

    form = QueueForm
    fields = ("name", "paused", "max_length", "when_full", "full_timeout")
    list_filter = ("paused",)
    search_fields = ("name",)
    actions = ("pause_selected", "resume_selected")

    @property
    def using(self) -> str:
        return db.alias()

    def get_queryset(self, request):
        due = Job.objects.filter(queue=OuterRef("name"), status=Job.READY).order_by("run_at").values("run_at")
        return super().get_queryset(request).using(self.using).annotate(
            n_waiting=_jobs_of_queue(Job.READY),
            n_running=_jobs_of_queue(Job.RUNNING),
            oldest_ready=Subquery(due[:1]),
        )

    def get_list_display(self, request):
        return ("name", "waiting", QueueLive.of(request).oldest_due, "running", "paused", "max_length",
                "when_full")

    def get_readonly_fields(self, request, obj=None):
        return ("name",) if obj is not None else ()  # jobs name their queue: renaming would orphan them

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        obj.save(using=self.using)
        queue.forget_settings()

    def _link(self, obj: Queue, count: int, status: int) -> str:
        url = reverse("admin:leases_tasks_job_changelist")
        query = urlencode({"queue": obj.name, "status__exact": status})
        return format_html('<a href="{}?{}">{}</a>', url, query, count)

    @admin.display(description="waiting", ordering="n_waiting")
    def waiting(self, obj: Queue) -> str:
        return self._link(obj, obj.n_waiting, Job.READY)

    @admin.display(description="running", ordering="n_running")
    def running(self, obj: Queue) -> str:
        return self._link(obj, obj.n_running, Job.RUNNING)

    def _set_paused(self, request, queryset, paused: bool) -> None:
        changed = queryset.exclude(paused=paused).update(paused=paused)
        queue.forget_settings()
        verb = "Paused" if paused else "Resumed"
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
        rows = Job.objects.using(db.alias()).filter(status=Job.RUNNING, worker__in=names)
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
        url = reverse("admin:leases_tasks_job_changelist")
        links = [format_html('<a href="{}{}/change/">{} #{}</a>', url, pk, name, pk)
                 for pk, name in self.jobs[obj.name]]
        return format_html_join(", ", "{}", ((link,) for link in links)) or EMPTY


@admin.register(Worker)
class QueueWorkerAdmin(ReadOnly):
    """`leases_worker` processes: alive while their lease is, and the jobs they run."""

    search_fields = ("name",)
    fields = ("name", "queues", "concurrency", "started_at", "heartbeat_at", "expires_at")

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
