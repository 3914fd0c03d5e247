"""Admin for pipeline runs: what each run is doing, a timeline of its tasks, and the
operator's steering (cancel, pause, resume, restart) through the engine.

Presentation only. Runs, stages and tasks change only through `leases.pipelines.engine`,
whose steps lock the run's row, so nothing here is edited by a form; the actions and the
buttons on a run's page call the engine, and each one is recorded in the admin's history.
A run's page reads a few grouped counts and at most TASK_LINES tasks per stage
(`leases.pipelines.report`), so a for_each of 10,000 items costs what a small one does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import path
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_POST

from leases.admin import EMPTY, OnDatabase, PerRequest, compact_time, mask_secrets, mask_text, request_now
from leases.management.text import elapsed, span
from leases.tasks.admin import _pre, may_change

from . import engine
from .models import Run, StageRun
from .report import STATUS_ORDER, RunReport, Timeline

#: Colour of each status, in the list, the stage table and the timeline.
COLOURS = {
    "succeeded": "#2e9c4a",
    "running": "#d08700",
    "queued": "#e0b84a",
    "waiting": "#b5b5b5",
    "paused": "#4a7fd0",
    "failed": "#d3372c",
    "cancelled": "#7a7a7a",
    "skipped": "#d5d5d5",
}
#: The timeline's geometry, in pixels.
LABEL_WIDTH, AXIS_WIDTH, ROW_HEIGHT, AXIS_HEIGHT = 200, 600, 16, 22
#: Tick spacings the timeline's axis may use, in seconds.
TICKS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    15,
    30,
    60,
    120,
    300,
    600,
    900,
    1800,
    3600,
    7200,
    10800,
    21600,
    43200,
    86400,
)


def badge(status: str) -> SafeString:
    return format_html(
        '<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
        COLOURS.get(status, "#999"),
        status,
    )


def restartable(run: Run, stages: list[StageRun]) -> StageRun | None:
    """The stage `restart` would most likely be asked for: the first failed one, else the
    first cancelled one (None when the run succeeded or has neither)."""
    if run.status == Run.SUCCEEDED:
        return None
    for wanted in (StageRun.FAILED, StageRun.CANCELLED):
        for stage in stages:
            if stage.status == wanted:
                return stage
    return None


class RunLive(PerRequest):
    """The run columns that depend on the database clock."""

    @admin.display(description="duration")
    def duration(self, obj: Run) -> str:
        now = request_now(self.request) if obj.status in Run.LIVE else None
        return elapsed(obj.queued_at, obj.finished_at, now) or EMPTY


class RunPage(PerRequest):
    """The fields of a run's page, read through one RunReport per request."""

    def __init__(self, request: HttpRequest) -> None:
        super().__init__(request)
        self.operator = may_change(request, Run._meta)
        self._reports: dict[int, RunReport] = {}

    def report(self, obj: Run) -> RunReport:
        if obj.pk not in self._reports:
            self._reports[obj.pk] = RunReport(obj, self.using)
        return self._reports[obj.pk]

    def shown(self, text: str) -> str:
        """Errors quote arguments and URLs, credentials included: as stored for those who
        may steer runs, masked for viewers (as job errors are)."""
        return (text if self.operator else mask_text(text)) or EMPTY

    @admin.display(description="error")
    def error_text(self, obj: Run) -> str:
        return self.shown(obj.error)

    @admin.display(description="duration")
    def duration(self, obj: Run) -> str:
        report = self.report(obj)
        return elapsed(obj.queued_at, obj.finished_at, report.now if report.live else None) or EMPTY

    @admin.display(description="context")
    def context_json(self, obj: Run) -> SafeString:
        return _pre(obj.context if self.operator else mask_secrets(obj.context))

    @admin.display(description="steer")
    def steer(self, obj: Run) -> SafeString | str:
        """Buttons for what the run's state allows; they post to the steer view with the
        page's own CSRF token (formaction), so the read-only form needs no template."""
        if not self.operator:
            return EMPTY
        url = self.admin_url("leases_pipelines_run_steer", obj.pk)
        choices: list[tuple[str, str]] = []
        if obj.status == Run.RUNNING:
            choices.append(("pause", "Pause"))
        if obj.status == Run.PAUSED:
            choices.append(("resume", "Resume"))
        if obj.status in Run.LIVE:
            choices.append(("cancel", "Cancel"))
        stage = restartable(obj, self.report(obj).stages)
        if stage is not None:
            choices.append((f"restart:{stage.name}", f"Restart stage {stage.name}"))
        if not choices:
            return EMPTY
        return format_html_join(
            " ",
            '<button type="submit" class="button" formaction="{}" name="steer" value="{}">{}</button>',
            ((url, value, label) for value, label in choices),
        )

    @admin.display(description="stages")
    def stages_table(self, obj: Run) -> SafeString:
        report = self.report(obj)
        head = ("Stage", "Status", "Tasks done", "Started", "Finished", "Duration", "Restarts", "Error")
        rows = []
        for stage in report.stages:
            start, end, going = report.stage_times(stage)
            rows.append(
                format_html(
                    "<tr><td><strong>{}</strong></td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td><td>{}</td>"
                    "<td>{}</td><td>{}</td></tr>",
                    stage.name,
                    badge(stage.status),
                    report.done(stage),
                    report.total(stage),
                    _time(start),
                    _time(end),
                    elapsed(start, end, going) or EMPTY,
                    stage.restarts,
                    self.shown(stage.error),
                )
            )
            if report.picked[stage.pk]:
                rows.append(
                    format_html('<tr><td></td><td colspan="7">{}</td></tr>', self._tasks(report, stage))
                )
        return _table(head, rows)

    def _tasks(self, report: RunReport, stage: StageRun) -> SafeString:
        head = ("Task", "Item", "Status", "Attempts", "Duration", "Job", "Error")
        rows = []
        for task in report.picked[stage.pk]:
            start, end = report.times(task)
            job = EMPTY
            if task.job_id:
                job = format_html(
                    '<a href="{}">#{}</a>',
                    self.admin_url("leases_tasks_job_change", task.job_id),
                    task.job_id,
                )
            rows.append(
                format_html(
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    task.task,
                    EMPTY if task.item_index is None else task.item_index,
                    badge(report.status(task)),
                    task.attempts,
                    elapsed(start, end, None) or EMPTY,
                    job,
                    self.shown(task.error),
                )
            )
        rest = report.left_out(stage)
        if rest:
            parts = ", ".join(f"{rest[status]:,} {status}" for status in STATUS_ORDER if rest[status])
            rows.append(
                format_html(
                    '<tr><td colspan="7">… and {} more: {}</td></tr>', f"{sum(rest.values()):,}", parts
                )
            )
        return _table(head, rows)

    @admin.display(description="tasks over time")
    def timeline(self, obj: Run) -> SafeString | str:
        report = self.report(obj)
        found = report.timeline()
        if found is None:
            return "No task has started yet."
        return svg_timeline(found, report.now if report.live else None)


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
        return _time(obj.queued_at)

    @admin.display(description="first task started")
    def started_time(self, obj: Run) -> str:
        return _time(obj.started_at)

    @admin.display(description="finished")
    def finished(self, obj: Run) -> str:
        return _time(obj.finished_at)

    @admin.display(description="definition (as the run started)")
    def definition_json(self, obj: Run) -> SafeString:
        return _pre(obj.definition)

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
        run = get_object_or_404(Run.objects.using(self.using), pk=object_id)
        verb, _, stage = request.POST.get("steer", "").partition(":")
        calls: dict[str, Callable[[Run], Any]] = {
            "cancel": engine.cancel,
            "pause": engine.pause,
            "resume": engine.resume,
            "restart": lambda found: engine.restart(found, stage),
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
        self._each(request, queryset, "cancel", engine.cancel)

    @admin.action(description="Pause selected running runs", permissions=["operate"])
    def pause_selected(self, request, queryset):
        self._each(request, queryset, "pause", engine.pause)

    @admin.action(description="Resume selected paused runs", permissions=["operate"])
    def resume_selected(self, request, queryset):
        self._each(request, queryset, "resume", engine.resume)

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
            engine.restart(run, stage.name)
            return True

        self._each(request, queryset, "restart", restart)


# -- rendering --------------------------------------------------------------------------


def _time(value: datetime | None) -> str:
    return timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S") if value else EMPTY


def _table(head: tuple[str, ...], rows: list[SafeString]) -> SafeString:
    header = format_html_join("", "<th>{}</th>", ((name,) for name in head))
    return format_html(
        '<table style="width: 100%"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>',
        header,
        mark_safe("".join(rows)),
    )  # noqa: S308 - each row was built by format_html


def _tick(seconds: float) -> float:
    """The axis step giving about six ticks over `seconds`."""
    return next((step for step in TICKS if seconds / step <= 8), TICKS[-1] * (seconds // (TICKS[-1] * 8) + 1))


def _px(value: float) -> str:
    return f"{value:.1f}"


def svg_timeline(found: Timeline, now: datetime | None) -> SafeString:
    """One bar per task on a common time axis (stages in order), as inline SVG: no script,
    a tooltip per bar, a line at now while the run is live."""
    width = LABEL_WIDTH + AXIS_WIDTH + 10
    height = AXIS_HEIGHT + ROW_HEIGHT * len(found.bars) + 6
    label = f"timeline of {len(found.bars)} task(s) over {span(found.seconds)}"
    parts = [format_html(
        '<svg class="leases-timeline" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" role="img"'
        ' aria-label="{}" style="font: 11px sans-serif; background: #fff">', width, height, label,
    )]
    step, tick = _tick(found.seconds), 0.0
    while tick <= found.seconds + 1e-9:
        x = _px(LABEL_WIDTH + AXIS_WIDTH * tick / found.seconds)
        parts.append(format_html(
            '<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#e4e4e4"/>'
            '<text x="{0}" y="12" text-anchor="middle" fill="#666">{3}</text>',
            x, AXIS_HEIGHT - 6, height, span(tick) if tick else "0",
        ))
        tick += step
    previous = None
    for row, bar in enumerate(found.bars):
        y = AXIS_HEIGHT + row * ROW_HEIGHT
        first = bar.stage.pk != previous
        previous = bar.stage.pk
        if first and row:
            parts.append(format_html('<line x1="0" y1="{0}" x2="{1}" y2="{0}" stroke="#bbb"/>', y, width))
        name = f"{bar.stage.name}: {bar.task}" if first else str(bar.task)
        start = LABEL_WIDTH + AXIS_WIDTH * found.offset(bar.start)
        end = LABEL_WIDTH + AXIS_WIDTH * found.offset(bar.end)
        took = span((bar.end - bar.start).total_seconds())
        parts.append(format_html(
            '<text x="{}" y="{}" fill="#333">{}</text><rect x="{}" y="{}" width="{}" height="{}" fill="{}">'
            "<title>{} / {}: {}, {} from {}</title></rect>",
            4 if first else 16, y + ROW_HEIGHT - 4, name[:38], _px(start), y + 2, _px(max(end - start, 2.0)),
            ROW_HEIGHT - 4, COLOURS.get(bar.status, "#999"), bar.stage.name, bar.task, bar.status, took,
            _time(bar.start),
        ))
    if now is not None:
        parts.append(format_html(
            '<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#4a7fd0" stroke-dasharray="3,2">'
            "<title>now</title></line>",
            _px(LABEL_WIDTH + AXIS_WIDTH * found.offset(now)), AXIS_HEIGHT - 6, height,
        ))
    legend = format_html_join(
        " ", '<span style="white-space: nowrap"><span style="color: {}">■</span> {}</span>',
        ((COLOURS[status], status) for status in ("succeeded", "running", "failed", "cancelled")),
    )
    note = f"; {found.not_started} task(s) listed above have not started" if found.not_started else ""
    return format_html(
        '<div style="overflow-x: auto">{}</svg></div><p class="help">{} ({} from {}{})</p>',
        mark_safe("".join(parts)),  # noqa: S308 - each part was built by format_html
        legend, span(found.seconds), _time(found.origin), note,
    )
