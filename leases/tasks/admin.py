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
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Count, IntegerField, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join

from leases.admin import (
    EMPTY,
    OnDatabase,
    OnDatabaseInline,
    PerRequest,
    _nowrap,
    compact_time,
    mask_secrets,
    mask_text,
    request_now,
)
from leases.management.text import ago, elapsed

from . import limits, queue, registry, schedules
from .dispatcher import Dispatcher
from .models import (
    DispatchWorker,
    Job,
    JobError,
    LimitKey,
    LimitRule,
    PoolTask,
    Queue,
    Schedule,
    ScheduleRun,
    TaskPool,
    Worker,
)
from .worker import recover_lapsed


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


class ReadOnly(OnDatabase, admin.ModelAdmin):
    """Rows of the engine's database (settings.LEASES_DATABASE), to look at only."""

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
        returned = 0
        for row in queryset:
            back = Dispatcher(row.name, using=self.using).reclaim()
            returned += back
            self.log_change(request, row, f"Reclaimed from the admin: {back} task(s) back in the pool.")
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
#: Newest jobs whose names the name filter offers beside the registered handlers.
RECENT_NAMES = 1000
LAPSED_HELP = (
    "Its worker stopped heartbeating, so its lease lapsed: any live worker puts it back to ready "
    "(or dead, when out of attempts) within seconds, or use the action 'Recover selected lapsed jobs now'. "
    "Then it can be cancelled or discarded."
)


def relative(moment: datetime | None, now: datetime) -> str:
    """'in 3s' or '12s ago' by the database clock; the exact time on hover."""
    if moment is None:
        return EMPTY
    return format_html('<span style="white-space: nowrap" title="{}">{}</span>',
                       timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S"), ago(moment, now))


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
    """Handlers registered in this process and the names of the newest jobs (Django Tasks
    and pipeline tasks too), read by primary key; any name works as ?name=... in the URL."""

    title = "name"
    parameter_name = "name"

    def lookups(self, request, model_admin):
        recent = Job.objects.using(model_admin.using).order_by("-id").values_list("name", flat=True)[:RECENT_NAMES]
        return [(n, n) for n in sorted(set(registry.registered()) | set(recent))]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(name=self.value())


class LeaseFilter(admin.SimpleListFilter):
    """Running jobs whose worker stopped heartbeating (their lease lapsed, by the database
    clock): a live worker recovers them within seconds, or the action does now."""

    title = "lease"
    parameter_name = "lease"

    def lookups(self, request, model_admin):
        return [("lapsed", "lapsed (worker gone)"), ("live", "live")]

    def queryset(self, request, queryset):
        now = request_now(request)
        if self.value() == "lapsed":
            return queryset.filter(status=Job.RUNNING, expires_at__lte=now)
        if self.value() == "live":
            return queryset.filter(status=Job.RUNNING, expires_at__gt=now)
        return queryset


class LimitKeyFilter(admin.SimpleListFilter):
    """Jobs of one limited key, by the small LimitKey table (the first 20 are offered; any
    key works as ?limit_key=... in the URL)."""

    title = "limited key"
    parameter_name = "limit_key"

    def lookups(self, request, model_admin):
        return [(key, key) for key in LimitKey.objects.using(model_admin.using).values_list("name", flat=True)[:20]]

    def has_output(self) -> bool:
        return True  # filter by a key given in the URL even when none is blocked now

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(limit_key=self.value())


class JobLive(PerRequest):
    """The job columns that depend on the database clock."""

    @admin.display(description="status", ordering="status")
    def status_text(self, obj: Job) -> str:
        return _nowrap(Job.describe(obj.status, obj.attempt, obj.expires_at, request_now(self.request)))

    @admin.display(description="run at", ordering="run_at")
    def run_in(self, obj: Job) -> str:
        return relative(obj.run_at, request_now(self.request))

    @admin.display(description="duration")
    def duration(self, obj: Job) -> str:
        """Start to finish, or to now while it runs (database clock)."""
        now = request_now(self.request) if obj.status == Job.RUNNING else None
        return elapsed(obj.started_at, obj.finished_at, now) or EMPTY

    @admin.display(description="lease", ordering="expires_at")
    def lease(self, obj: Job) -> str:
        """A running job's lease: renewed by its worker's heartbeat; lapsed when it is gone."""
        if obj.status != Job.RUNNING or obj.expires_at is None:
            return EMPTY
        return relative(obj.expires_at, request_now(self.request))


class JobErrorInline(OnDatabaseInline, admin.TabularInline):
    """What each failed attempt raised, oldest first."""

    model = JobError
    extra = 0
    can_delete = False

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

    list_filter = (QueueFilter, "status", LeaseFilter, NameFilter, LimitKeyFilter)
    search_fields = ("^name", "^key", "^limit_key")
    ordering = ("-id",)
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    count_limit = 10000
    inlines = (JobErrorInline,)
    actions = ("retry_selected", "cancel_selected", "discard_selected", "recover_selected")

    def get_search_results(self, request, queryset, search_term):
        """A number finds that job; words find names, keys and limit keys by prefix."""
        term = search_term.strip().lstrip("#")
        if term.isdigit():
            return queryset.filter(pk=int(term)), False
        return super().get_search_results(request, queryset, search_term)

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        return CappedPaginator(queryset, per_page, orphans, allow_empty_first_page, limit=self.count_limit)

    def get_list_display(self, request):
        live = JobLive.of(request)
        return ("id", "name", "queue", live.status_text, "attempts", live.run_in, "started", live.duration,
                live.lease, "worker_short", "finished")

    def get_fieldsets(self, request, obj=None):
        """Who may act on jobs sees payload and result as stored; viewers see them masked
        (as resource data), since handlers take and return credentials too."""
        live = JobLive.of(request)
        if may_change(request, self.opts):
            shown = ("payload_json", "result_json")
        else:
            shown = ("masked_payload", "masked_result")
        lapsed = (obj is not None and obj.status == Job.RUNNING and obj.expires_at is not None
                  and obj.expires_at <= request_now(request))
        return [
            (None, {
                "fields": ("name", "queue", "backend", live.status_text, "priority", "attempts", live.run_in,
                           "run_time", "worker", live.lease, "enqueued", "started", "finished", live.duration,
                           "key", "pending_key", "limit_key", "concurrency", "rate"),
                "description": LAPSED_HELP if lapsed else "",
            }),
            ("Payload and result", {"fields": shown}),
        ]

    @admin.display(description="attempts")
    def attempts(self, obj: Job) -> str:
        return f"{obj.attempt}/{obj.max_attempts}"

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, obj: Job) -> str | None:
        return compact_time(obj.finished_at)

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Job) -> str | None:
        return compact_time(obj.started_at)

    @admin.display(description="queued", ordering="enqueued_at")
    def enqueued(self, obj: Job) -> str | None:
        return compact_time(obj.enqueued_at)

    @admin.display(description="run time", ordering="run_at")
    def run_time(self, obj: Job) -> str | None:
        return compact_time(obj.run_at)

    @admin.display(description="worker", ordering="worker")
    def worker_short(self, obj: Job) -> str:
        """host:pid, the whole name (with its random part) on hover."""
        if not obj.worker:
            return EMPTY
        short = ":".join(obj.worker.split(":")[:2])
        return format_html('<span style="white-space: nowrap" title="{}">{}</span>', obj.worker, short)

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

    def _apply(self, request, queryset, call, verb: str, skipped: str, eligible: tuple[int, ...]) -> None:
        """Call `call(ids)` in batches and record it in the history of the jobs it may
        have changed (those of an `eligible` status when it ran)."""
        ids = list(queryset.values_list("id", flat=True))
        batches = [ids[i : i + ACTION_BATCH] for i in range(0, len(ids), ACTION_BATCH)]
        done = 0
        for batch in batches:
            touched = list(Job.objects.using(self.using).filter(pk__in=batch, status__in=eligible))
            done += call(batch, using=self.using)
            for job in touched:
                self.log_change(request, job, f"{verb} from the admin.")
        text = f"{verb} {done} of {len(ids)} selected job{'s' if len(ids) != 1 else ''}."
        if done < len(ids):
            text += f" {len(ids) - done} {skipped}."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Retry selected failed, dead or cancelled jobs now", permissions=["operate"])
    def retry_selected(self, request, queryset):
        self._apply(request, queryset, queue.retry, "Retried", "not failed, dead or cancelled",
                    (Job.FAILED, Job.DEAD, Job.CANCELLED))

    @admin.action(description="Cancel selected waiting jobs", permissions=["operate"])
    def cancel_selected(self, request, queryset):
        self._apply(request, queryset, queue.cancel, "Cancelled", "not waiting", Job.WAITING)

    @admin.action(description="Discard selected jobs that are not running", permissions=["operate"])
    def discard_selected(self, request, queryset):
        self._apply(request, queryset, queue.discard, "Discarded", "running",
                    tuple(status for status, _ in Job.STATUSES if status != Job.RUNNING))

    @admin.action(description="Recover selected lapsed jobs now (their worker is gone)", permissions=["operate"])
    def recover_selected(self, request, queryset):
        """What a live worker does within seconds: back to ready (or dead when out of
        attempts), with a WorkerLost error; then they can be cancelled or discarded."""
        ids = list(queryset.filter(status=Job.RUNNING, expires_at__lte=request_now(request))
                   .values_list("id", flat=True))
        by = f"the admin ({request.user.get_username()})"
        done = recover_lapsed(self.using, by=by, ids=ids) if ids else 0
        for job in Job.objects.using(self.using).filter(pk__in=ids).exclude(status=Job.RUNNING):
            self.log_change(request, job, "Recovered from the admin (its worker had stopped heartbeating).")
        selected = queryset.count()
        text = f"Recovered {done} of {selected} selected job{'s' if selected != 1 else ''}."
        if done < selected:
            text += f" {selected - done} not running with a lapsed lease."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)


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
class QueueAdmin(OnDatabase, admin.ModelAdmin):
    """Queues: their backlog and settings. Counts are subqueries over the claim index, one
    query per page. Rows are made on first push and kept (deleting one would drop a pause),
    and a changed setting reaches every process within queue.SETTINGS_TTL."""

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
        queue.forget_settings()

    def _link(self, obj: Queue, count: int, status: int) -> str:
        url = self.admin_url("leases_tasks_job_changelist")
        query = urlencode({"queue": obj.name, "status__exact": status})
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
        queue.forget_settings()
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


# -- schedules --------------------------------------------------------------------------
#
# Saved through `schedules.schedule()`, so the form checks what the API checks and a
# changed timing starts again from the database clock. Rows from LEASES_SCHEDULES are
# shown read-only: the settings are their source, and a worker's start would undo an edit.


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
    fields = ("number", "tick", "fired", "job", "status", "duration", "error")
    readonly_fields = fields
    ordering = ("-number",)

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
        what = ("name", "handler", "pipeline", "payload", "queue", "priority")
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


# -- per-key limits -----------------------------------------------------------------------


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
        return ("name", "running", "blocked", "ready", "concurrency", "rate", "at_limit", "decisions")

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

    @admin.display(description="at its limit", boolean=True)
    def at_limit(self, obj: LimitKey) -> bool:
        found = self._limits(obj)
        return obj.n_blocked > 0 or (found.concurrency is not None and obj.n_running >= found.concurrency)
