"""A run's page: its state, steering buttons, stages and tasks, timeline and context,
read through one RunReport per request.

A run's page reads a few grouped counts and at most TASK_LINES tasks per stage
(`leases.pipelines.report`), so a for_each of 10,000 items costs what a small one does.
"""
from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from leases.management.text import elapsed
from leases.ops.adminkit import EMPTY, PerRequest, local_time, may_change, pretty_json
from leases.ops.masking import mask_secrets, mask_text

from ..models import Run, StageRun
from ..report import STATUS_ORDER, RunReport
from .badges import badge
from .timeline import svg_timeline


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

    def masks(self, field: str) -> bool:
        """Whether the run admin's `masked` masks `field` for this request's user."""
        return self.request.leases_admin.masks(self.request, field)

    def shown(self, text: str, field: str) -> str:
        """Errors quote arguments and URLs, credentials included: as stored for those who
        may steer runs, masked for viewers (as job errors are), as the run admin's
        `masked` says of `field`."""
        return (mask_text(text) if self.masks(field) else text) or EMPTY

    @admin.display(description="error")
    def error_text(self, obj: Run) -> str:
        return self.shown(obj.error, "error")

    @admin.display(description="duration")
    def duration(self, obj: Run) -> str:
        report = self.report(obj)
        return elapsed(obj.queued_at, obj.finished_at, report.now if report.live else None) or EMPTY

    @admin.display(description="context")
    def context_json(self, obj: Run) -> SafeString:
        return pretty_json(mask_secrets(obj.context) if self.masks("context") else obj.context)

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
                    local_time(start),
                    local_time(end),
                    elapsed(start, end, going) or EMPTY,
                    stage.restarts,
                    self.shown(stage.error, "stages__error"),
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
                    self.shown(task.error, "tasks__error"),
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


def _table(head: tuple[str, ...], rows: list[SafeString]) -> SafeString:
    header = format_html_join("", "<th>{}</th>", ((name,) for name in head))
    return format_html(
        '<table style="width: 100%"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>',
        header,
        mark_safe("".join(rows)),
    )  # noqa: S308 - each row was built by format_html
