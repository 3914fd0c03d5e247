"""Admin of the job queue's jobs: state to look at, the engine to act.

Jobs change only through the operator actions (`leases.tasks.jobs.actions`) and the
workers' fenced statements: a form saving a whole Job row it read a moment ago could
undo a claim or an outcome, so jobs are shown read-only. Every page reads the database
clock once.
"""
from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.views.main import SEARCH_VAR
from django.db.models import QuerySet
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from leases import conf
from leases.management.text import ago, elapsed
from leases.models import Resource
from leases.ops.adminkit import (
    EMPTY,
    CappedPaginator,
    OnDatabaseInline,
    PerRequest,
    as_id,
    compact_time,
    local_time,
    may_change,
    pretty_json,
    request_now,
)
from leases.ops.masking import mask_secrets, mask_task_call, mask_text

from .. import registry
from ..jobs import actions, waits
from ..jobs.recovery import recover_lapsed
from ..jobs.steps import waiting
from ..models import Job, JobError, JobEvent, JobStep, LimitKey, Queue
from . import durable, search
from .shared import ReadOnly, relative

#: Ids per engine call, well under the placeholder limits of MySQL and SQLite.
ACTION_BATCH = 500
#: Newest jobs whose names the name filter offers beside the registered handlers.
RECENT_NAMES = 1000
#: A worker's name in the list: one line, at most this wide.
WORKER_STYLE = ("display: inline-block; max-width: 8em; overflow: hidden; text-overflow: ellipsis;"
                " white-space: nowrap; vertical-align: bottom")
LAPSED_HELP = (
    "Its worker stopped heartbeating, so its lease lapsed: any live worker puts it back to ready "
    "(or dead, when out of attempts) within seconds, or use the action 'Recover selected lapsed jobs now'. "
    "Then it can be cancelled or discarded."
)


def _folded(text: str) -> str:
    """A traceback behind a "show" toggle, so the errors table stays one line per attempt."""
    if not text:
        return EMPTY
    return format_html('<details><summary>show</summary><pre style="margin: 0">{}</pre></details>', text)


class QueueFilter(admin.SimpleListFilter):
    """Queues by the small Queue table, not a DISTINCT over every job."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request, model_admin):
        return [(n, n) for n in Queue.objects.using(model_admin.using).values_list("name", flat=True)]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(queue=self.value())


#: The kinds of jobs the list shows besides its default, the operators' own.
INTERNAL, ALL = "internal", "all"


def of_kind(queryset: QuerySet, kind: str | None) -> QuerySet:
    """Jobs of `kind`: the apps' bookkeeping (registry.internal_names(): a pipeline's
    advance events), all, or by default the rest, the jobs operators push and run."""
    internal = sorted(registry.internal_names())
    if kind == INTERNAL:
        return queryset.filter(name__in=internal)
    return queryset if kind == ALL else queryset.exclude(name__in=internal)


class KindFilter(admin.SimpleListFilter):
    """Operators' jobs unless asked: a busy pipeline's advance events would crowd them out
    of the list. A search for a job's id finds it whatever its kind."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request, model_admin):
        return [(INTERNAL, "internal"), (ALL, "all")]

    def choices(self, changelist):
        default, *rest = super().choices(changelist)
        return [{**default, "display": "operators' jobs"}, *rest]

    def queryset(self, request, queryset):
        if as_id(request.GET.get(SEARCH_VAR, "").strip().lstrip("#")) is not None:
            return queryset
        return of_kind(queryset, self.value())


class NameFilter(admin.SimpleListFilter):
    """Handlers registered in this process and the names of the newest jobs (Django Tasks
    and pipeline tasks too), read by primary key, of the kind the list shows; any name
    works as ?name=... in the URL."""

    title = "name"
    parameter_name = "name"

    def lookups(self, request, model_admin):
        kind = request.GET.get(KindFilter.parameter_name)
        newest = of_kind(Job.objects.using(model_admin.using), kind).order_by("-id")
        recent = newest.values_list("name", flat=True)[:RECENT_NAMES]
        internal = registry.internal_names()
        handlers = {n for n in registry.registered() if kind == ALL or (n in internal) == (kind == INTERNAL)}
        return [(n, n) for n in sorted(handlers | set(recent))]

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
        return Job.describe(obj.status, obj.attempt, obj.expires_at, request_now(self.request), obj.waiting_for)

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

    @admin.display(description="waits for")
    def waits_for(self, obj: Job) -> str:
        """What a suspended durable job waits for, and until when (a wait's timeout)."""
        return waiting(obj.waiting_for, obj.run_at, request_now(self.request), local_time)

    @admin.display(description="when")
    def when(self, obj: Job) -> str:
        """The list's one time column, so a row fits the page: when a waiting job is due,
        how long a running one has run, when a finished one ended and what it took. The
        times themselves on hover (and every one of them on the job's page)."""
        now = request_now(self.request)
        if obj.status in Job.WAITING:
            parts, times = [ago(obj.run_at, now)], [("due", obj.run_at)]
        elif obj.status == Job.RUNNING:
            parts = [f"for {elapsed(obj.started_at, None, now)}" if obj.started_at else EMPTY]
            times = [("started", obj.started_at), ("lease until", obj.expires_at)]
        else:
            took = elapsed(obj.started_at, obj.finished_at, None)
            parts = [ago(obj.finished_at, now) if obj.finished_at else EMPTY, *([f"took {took}"] if took else [])]
            times = [("started", obj.started_at), ("finished", obj.finished_at)]
        title = ", ".join(f"{label} {local_time(moment)}" for label, moment in times if moment)
        shown = format_html_join(", ", '<span style="white-space: nowrap">{}</span>', ((part,) for part in parts))
        return format_html('<span title="{}">{}</span>', title, shown)


class JobErrorInline(OnDatabaseInline, admin.TabularInline):
    """What each failed attempt raised, oldest first."""

    model = JobError
    extra = 0
    can_delete = False

    def get_fields(self, request, obj=None):
        """Messages and tracebacks quote arguments, URLs and headers, credentials included:
        as the payload, they are shown as stored only to those who may act on the job
        (the job admin's `masked`)."""
        masks = request.leases_admin.masks
        return ("attempt", "exception", "masked_message" if masks(request, "errors__message") else "message",
                "masked_trace" if masks(request, "errors__traceback") else "trace", "worker", "when")

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj)

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    @admin.display(description="message")
    def masked_message(self, obj: JobError) -> str:
        return mask_text(obj.message)

    @admin.display(description="at")
    def when(self, obj: JobError) -> str:
        return local_time(obj.at)

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

    #: Shown as stored to those who may change jobs, masked for viewers: what handlers
    #: take and return, what they raised, their steps' results and their events' data.
    masked = ("payload", "result", "errors__message", "errors__traceback", "steps__result", "events__data")
    list_filter = (KindFilter, QueueFilter, "status", LeaseFilter, NameFilter, LimitKeyFilter)
    search_fields = ("^name", "^key", "^limit_key")
    search_help_text = search.HELP
    ordering = ("-id",)
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    count_limit = 10000
    inlines = (JobErrorInline,)
    actions = ("retry_selected", "cancel_selected", "discard_selected", "recover_selected", "send_event_selected")

    def get_search_results(self, request, queryset, search_term):
        """A number finds that job; payload terms match a payload's field; other words find
        names, keys and limit keys by prefix (search.HELP). A term that cannot be read
        finds nothing and says why, and so does a payload term of a user who sees payloads
        masked: what it found would tell the masked value."""
        pk = as_id(search_term.strip().lstrip("#"))
        if pk is not None:
            return queryset.filter(pk=pk), False
        try:
            terms = search.split(search_term)
        except ValueError as exc:
            self.message_user(request, f"Search: {exc}.", messages.WARNING)
            return queryset.none(), False
        if terms.payload and self.masks(request, "payload"):
            self.message_user(request, "Search: payload fields are searched only by users who may change jobs, "
                                       "who see payloads as stored.", messages.WARNING)
            return queryset.none(), False
        if terms.payload:
            queryset = search.by_payload(queryset, terms.payload)
        return super().get_search_results(request, queryset, terms.words)

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        return CappedPaginator(queryset, per_page, orphans, allow_empty_first_page, limit=self.count_limit)

    def get_list_display(self, request):
        """Seven columns, so a row fits a 1,400 px screen beside the admin's sidebars; what
        the list leaves out (the queued, start and end times, the lease, the worker's whole
        name) is on the job's page."""
        live = JobLive.of(request)
        return ("id", "job_name", "queue", live.status_text, "attempts", live.when, "worker_short")

    def get_fieldsets(self, request, obj=None):
        """Who may act on jobs sees payload and result as stored; viewers see them masked
        (as resource data), since handlers take and return credentials too."""
        live = JobLive.of(request)
        shown = ("masked_payload" if self.masks(request, "payload") else "payload_json",
                 "masked_result" if self.masks(request, "result") else "result_json")
        lapsed = (obj is not None and obj.status == Job.RUNNING and obj.expires_at is not None
                  and obj.expires_at <= request_now(request))
        return [
            (None, {
                "fields": ("name", "queue", "backend", live.status_text, "priority", "attempts", live.run_in,
                           "run_time", "worker", live.lease, "enqueued", "started", "finished", live.duration,
                           "key", "pending_key", "limit_key", "concurrency", "rate"),
                "description": LAPSED_HELP if lapsed else "",
            }),
            *([("Resource", {"fields": ("pool", "target", "affinity", "held_resource")})] if obj and obj.pool else []),
            ("Payload and result", {"fields": shown}),
            *([("Steps and events", {"fields": self._durable_fields(request, obj)})] if self._durable(obj) else []),
        ]

    def _durable(self, obj: Job | None) -> bool:
        """Whether the job is durable: it waits, was asked to stop, or stepped (an index read)."""
        if obj is None:
            return False
        return bool(obj.waiting_for or obj.cancel_requested_at) or JobStep.objects.using(self.using).filter(
            job_id=obj.pk).exists() or JobEvent.objects.using(self.using).filter(job_id=obj.pk).exists()

    def _durable_fields(self, request, obj: Job) -> tuple[str, ...]:
        shown = ("masked_steps" if self.masks(request, "steps__result") else "steps",
                 "masked_events" if self.masks(request, "events__data") else "events")
        return (*((JobLive.of(request).waits_for,) if obj.status == Job.READY and obj.waiting_for else ()),
                *(("cancel_requested_at",) if obj.cancel_requested_at else ()), *shown)

    @admin.display(description="steps")
    def steps(self, obj: Job) -> str:
        return durable.steps_table(obj.pk, self.using, masked=False)

    @admin.display(description="steps")
    def masked_steps(self, obj: Job) -> str:
        return durable.steps_table(obj.pk, self.using, masked=True)

    @admin.display(description="events")
    def events(self, obj: Job) -> str:
        return durable.events_table(obj.pk, self.using, masked=False)

    @admin.display(description="events")
    def masked_events(self, obj: Job) -> str:
        return durable.events_table(obj.pk, self.using, masked=True)

    @admin.display(description="holds")
    def held_resource(self, obj: Job) -> str:
        """The resource and fencing token its running attempt holds, linked to its page."""
        if obj.status in Job.WAITING:
            why = waits.of_job(obj, self.using).summary()
            return f"nothing yet: it is claimed only together with a free resource of its pool ({why})"
        if obj.status != Job.RUNNING or obj.resource_id is None:
            return EMPTY
        resource = Resource.objects.using(self.using).filter(pk=obj.resource_id).first()
        if resource is None:
            return f"resource #{obj.resource_id} (since removed), token {obj.lease_token}"
        return format_html('<a href="{}">{}</a>, token {}', self.admin_url("leases_resource_change", resource.pk),
                           str(resource), obj.lease_token)

    @admin.display(description="name", ordering="name")
    def job_name(self, obj: Job) -> str:
        """Wrapped at its dots when the column is narrow: a task's module path is long."""
        return format_html_join(mark_safe(".<wbr>"), "{}", ((part,) for part in obj.name.split(".")))

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
        """host:pid, a host name by its first label, cut short with an ellipsis if still
        long; the whole name (domain, random part) on hover."""
        if not obj.worker:
            return EMPTY
        host, *rest = obj.worker.split(":")
        if not host.replace(".", "").isdigit():  # an IPv4 address stays whole
            host = host.split(".")[0]
        short = ":".join([host, *rest[:1]])
        return format_html('<span style="{}" title="{}">{}</span>', WORKER_STYLE, obj.worker, short)

    @admin.display(description="payload")
    def payload_json(self, obj: Job) -> str:
        return pretty_json(obj.payload)

    @admin.display(description="payload")
    def masked_payload(self, obj: Job) -> str:
        if obj.backend in conf.tasks_entries():  # a Django task's: its positional arguments too
            return pretty_json(mask_task_call(obj.name, obj.payload))
        return pretty_json(mask_secrets(obj.payload))

    @admin.display(description="result")
    def result_json(self, obj: Job) -> str:
        return EMPTY if obj.result is None else pretty_json(obj.result)

    @admin.display(description="result")
    def masked_result(self, obj: Job) -> str:
        return EMPTY if obj.result is None else pretty_json(mask_secrets(obj.result))

    # -- actions: through leases.tasks.jobs.actions -------------------------------------------

    def has_operate_permission(self, request) -> bool:
        return may_change(request, self.opts)

    def _apply(self, request, queryset, call, verb: str, skipped: str, eligible: tuple[int, ...]) -> None:
        """Call `call(ids)` in batches and record it in the history of the jobs it may
        have changed (those of an `eligible` status when it ran); a running job that is
        eligible (cancel) is asked to stop, and the message says how many were."""
        ids = list(queryset.values_list("id", flat=True))
        batches = [ids[i : i + ACTION_BATCH] for i in range(0, len(ids), ACTION_BATCH)]
        done = asked = 0
        for batch in batches:
            touched = list(Job.objects.using(self.using).filter(pk__in=batch, status__in=eligible))
            done += call(batch, using=self.using)
            for job in touched:
                running = job.status == Job.RUNNING
                asked += running
                self.log_change(request, job, f"{verb} from the admin{' (running: asked to stop)' if running else ''}.")
        text = f"{verb} {done} of {len(ids)} selected job{'s' if len(ids) != 1 else ''}."
        if asked:
            text += f" {asked} running: asked to stop at their worker's next heartbeat."
        if done < len(ids):
            text += f" {len(ids) - done} {skipped}."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Retry selected failed, dead or cancelled jobs now", permissions=["operate"])
    def retry_selected(self, request, queryset):
        self._apply(request, queryset, actions.retry, "Retried", "not failed, dead or cancelled",
                    (Job.FAILED, Job.DEAD, Job.CANCELLED))

    @admin.action(description="Cancel selected jobs (running ones are asked to stop)", permissions=["operate"])
    def cancel_selected(self, request, queryset):
        self._apply(request, queryset, actions.cancel, "Cancelled", "ended already", (*Job.WAITING, Job.RUNNING))

    @admin.action(description="Discard selected jobs that are not running", permissions=["operate"])
    def discard_selected(self, request, queryset):
        self._apply(request, queryset, actions.discard, "Discarded", "running",
                    tuple(status for status, _ in Job.STATUSES if status != Job.RUNNING))

    @admin.action(description="Send an event to selected jobs...", permissions=["operate"])
    def send_event_selected(self, request, queryset):
        return durable.send_event(self, request, queryset)

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
