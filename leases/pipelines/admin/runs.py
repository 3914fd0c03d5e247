"""Admin of pipeline runs: the list, with each run's progress, and the operator's
steering (cancel, pause, resume, restart) through the engine.

Presentation only. Runs, stages and tasks change only through `leases.pipelines.runs`,
whose steps lock the run's row, so nothing here is edited by a form; the actions and the
buttons on a run's page call the engine, and each one is recorded in the admin's history.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from leases.management.text import elapsed
from leases.ops.adminkit import (
    EMPTY,
    OnDatabase,
    PerRequest,
    as_id,
    compact_time,
    local_time,
    may_change,
    pretty_json,
    request_now,
)

from .. import runs
from ..models import Run, StageRun
from .badges import COLOURS, badge
from .page import RunPage, restartable


class RunLive(PerRequest):
    """The run columns that depend on the database clock."""

    @admin.display(description="duration")
    def duration(self, obj: Run) -> str:
        now = request_now(self.request) if obj.status in Run.LIVE else None
        return elapsed(obj.queued_at, obj.finished_at, now) or EMPTY


class PipelineFilter(admin.SimpleListFilter):
    """Pipelines with runs, read from the (pipeline, key) index."""

    title = "pipeline"
    parameter_name = "pipeline"

    def lookups(self, request, model_admin):
        names = Run.objects.using(model_admin.using).order_by("pipeline").values_list("pipeline", flat=True)
        return [(name, name) for name in names.distinct()]

    def queryset(self, request, queryset):
        return queryset if self.value() is None else queryset.filter(pipeline=self.value())


@admin.register(Run)
class RunAdmin(OnDatabase, admin.ModelAdmin):
    """Pipeline runs, newest first, and a run's stages, tasks and timeline."""

    #: Shown as stored to those who may steer runs, masked for viewers (or not shown at
    #: all): a run's context, the errors of the run, its stages and tasks, the data of its
    #: events, its tasks' items and results.
    masked = ("context", "error", "events", "stages__error", "tasks__error", "tasks__item", "tasks__result")
    list_filter = ("status", PipelineFilter)
    search_fields = ("^pipeline", "^key")
    ordering = ("-id",)
    show_full_result_count = False
    actions = ("cancel_selected", "pause_selected", "resume_selected", "restart_selected")

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using).defer("definition", "context").with_progress()

    def get_object(self, request, object_id, from_field=None):
        # The run's page shows its definition and context, which the list defers.
        try:
            return Run.objects.using(self.using).with_progress().filter(pk=int(object_id)).first()
        except (TypeError, ValueError, OverflowError):
            return None

    def has_add_permission(self, request) -> bool:
        return False  # runs are started by Pipeline.start or `manage.py pipeline start`

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # read-only: the engine's steps are the only writers

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # a live run's jobs would run for nothing; prune finished runs instead

    def has_operate_permission(self, request) -> bool:
        """Steering takes the change permission, which no form uses."""
        return may_change(request, self.opts)

    # -- list -------------------------------------------------------------------------

    def get_list_display(self, request):
        return (
            "id",
            "pipeline",
            "key_text",
            "status_badge",
            "progress",
            "started",
            RunLive.of(request).duration,
        )

    @admin.display(description="key", ordering="key")
    def key_text(self, obj: Run) -> str:
        return obj.key or EMPTY

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Run) -> SafeString:
        return badge(obj.status)

    @admin.display(description="progress")
    def progress(self, obj: Run) -> SafeString:
        """Tasks done of the tasks made so far (a for_each adds its items when it starts)."""
        share = obj.tasks_done / obj.tasks_total if obj.tasks_total else 0.0
        return format_html(
            '<span style="white-space: nowrap" title="{}% of the tasks made so far">'
            '<span style="display: inline-block; width: 60px; height: 8px; background: #e4e4e4;'
            ' vertical-align: middle"><span style="display: block; width: {}px; height: 8px; background: {}">'
            "</span></span> {}/{}</span>",
            f"{share * 100:.0f}",
            round(share * 60),
            COLOURS.get(obj.status, "#999"),
            obj.tasks_done,
            obj.tasks_total,
        )

    @admin.display(description="started", ordering="queued_at")
    def started(self, obj: Run) -> str | None:
        return compact_time(obj.queued_at)

    # -- a run's page -----------------------------------------------------------------

    def get_fieldsets(self, request, obj=None):
        page = RunPage.of(request)
        return [
            (
                None,
                {"fields": ("pipeline", "key_text", "status_badge", page.error_text, "progress", page.steer)},
            ),
            ("Times (database clock)", {"fields": ("queued", "started_time", "finished", page.duration)}),
            ("Stages and tasks", {"fields": (page.stages_table,)}),
            ("Timeline", {"fields": (page.timeline,)}),
            ("Context", {"fields": (page.context_json,)}),
            ("Definition", {"fields": ("definition_json",), "classes": ("collapse",)}),
        ]

    def get_readonly_fields(self, request, obj=None):
        return [field for _, options in self.get_fieldsets(request, obj) for field in options["fields"]]

    @admin.display(description="queued")
    def queued(self, obj: Run) -> str:
        return local_time(obj.queued_at)

    @admin.display(description="first task started")
    def started_time(self, obj: Run) -> str:
        return local_time(obj.started_at)

    @admin.display(description="finished")
    def finished(self, obj: Run) -> str:
        return local_time(obj.finished_at)

    @admin.display(description="definition (as the run started)")
    def definition_json(self, obj: Run) -> SafeString:
        return pretty_json(obj.definition)

    # -- steering ---------------------------------------------------------------------

    def get_urls(self):
        steer = self.admin_site.admin_view(require_POST(self.steer_view))
        return [
            path("<path:object_id>/steer/", steer, name="leases_pipelines_run_steer"),
            *super().get_urls(),
        ]

    def steer_view(self, request: HttpRequest, object_id: str) -> HttpResponseRedirect:
        """One button of a run's page: cancel, pause, resume or restart:STAGE."""
        if not self.has_operate_permission(request):
            raise PermissionDenied
        pk = as_id(object_id)  # a URL's id that is no number is no run: 404, not a 500
        if pk is None:
            raise Http404("No run matches the given query.")
        run = get_object_or_404(Run.objects.using(self.using), pk=pk)
        verb, _, stage = request.POST.get("steer", "").partition(":")
        calls: dict[str, Callable[[Run], Any]] = {
            "cancel": runs.cancel,
            "pause": runs.pause,
            "resume": runs.resume,
            "restart": lambda found: runs.restart(found, stage),
        }
        if verb not in calls:
            self.message_user(request, "Nothing to do: unknown button.", messages.ERROR)
        else:
            self._steer(request, run, verb, calls[verb], stage)
        return HttpResponseRedirect(self.admin_url("leases_pipelines_run_change", run.pk))

    def _steer(
        self, request: HttpRequest, run: Run, verb: str, call: Callable[[Run], Any], stage: str = ""
    ) -> bool:
        """Apply one engine call, tell the user, record it; False when it did not apply."""
        what = f"restart of stage {stage}" if verb == "restart" else verb
        try:
            changed = call(run)
        except ValueError as exc:
            self.message_user(request, f"Run #{run.pk}: {exc}", messages.WARNING)
            return False
        if changed is False:
            self.message_user(
                request, f"Run #{run.pk}: nothing to {verb}, it is {run.status}.", messages.INFO
            )
            return False
        self.log_change(request, run, f"{what.capitalize()} from the admin.")
        self.message_user(request, f"Run #{run.pk}: {what} done; it is {run.status}.", messages.SUCCESS)
        return True

    def _each(self, request, queryset, verb: str, call: Callable[[Run], Any]) -> None:
        runs = list(queryset.only("pk", "pipeline", "status"))
        done = 0
        for run in runs:
            try:
                changed = call(run)
            except ValueError:
                continue
            if changed is not False:
                done += 1
                self.log_change(request, run, f"{verb.capitalize()} from the admin.")
        text = f"{verb.capitalize()}: {done} of {len(runs)} selected run{'s' if len(runs) != 1 else ''}."
        if done < len(runs):
            text += f" {len(runs) - done} did not apply (see each run's status)."
        self.message_user(request, text, messages.SUCCESS if done else messages.WARNING)

    @admin.action(description="Cancel selected live runs", permissions=["operate"])
    def cancel_selected(self, request, queryset):
        self._each(request, queryset, "cancel", runs.cancel)

    @admin.action(description="Pause selected running runs", permissions=["operate"])
    def pause_selected(self, request, queryset):
        self._each(request, queryset, "pause", runs.pause)

    @admin.action(description="Resume selected paused runs", permissions=["operate"])
    def resume_selected(self, request, queryset):
        self._each(request, queryset, "resume", runs.resume)

    @admin.action(
        description="Restart the failed (or cancelled) stage of selected runs", permissions=["operate"]
    )
    def restart_selected(self, request, queryset):
        def restart(run: Run) -> bool:
            stage = restartable(
                run, list(StageRun.objects.using(self.using).filter(run=run).order_by("position"))
            )
            if stage is None:
                return False
            runs.restart(run, stage.name)
            return True

        self._each(request, queryset, "restart", restart)
