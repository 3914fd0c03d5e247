"""Admin of the work dispatcher: state to look at, the engine to act.

Presentation only. Pools are rebuilt through `Dispatcher.recreate_task_pool` (the API or
the `dispatch` command) and tasks move only through the dispatcher's statements, so
nothing of the dispatcher can be added, edited or deleted; the one action calls
`Dispatcher.reclaim()`. The models join on the dispatcher's name (no foreign keys), so
the counts are correlated subqueries: one query per page, however many rows it shows.
"""
from __future__ import annotations

import math

from django.contrib import admin, messages
from django.db.models import Count, IntegerField, OuterRef, Subquery
from django.db.models.functions import Coalesce

from leases.ops.adminkit import PerRequest, compact_time, may_change, request_now

from ..dispatcher import Dispatcher
from ..models import DispatchWorker, PoolTask, TaskPool
from .shared import ReadOnly


def _count(queryset) -> Coalesce:
    """COUNT(*) of `queryset` as a column of the outer query (0 when nothing matches)."""
    counted = queryset.values("dispatcher").annotate(n=Count("*")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


def _tasks_of_dispatcher(state: int) -> Coalesce:
    return _count(PoolTask.objects.filter(dispatcher=OuterRef("name"), state=state))


@admin.register(TaskPool)
class TaskPoolAdmin(ReadOnly):
    """Dispatchers: where their tasks are, and the reclaim of stale workers' buckets."""

    list_display = ("name", "pool_size", "assigned", "done", "workers", "generation", "rebuilt")
    fields = ("name", "pool_size", "assigned", "done", "workers", "generation", "rebuild_started", "rebuilt")
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

    @admin.display(description="rebuild started")
    def rebuild_started(self, obj: TaskPool) -> str | None:
        return compact_time(obj.rebuild_started_at)

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
