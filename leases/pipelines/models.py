"""State of pipeline runs: one row per run, per stage of a run, per task of a stage.

Behaviour lives in the plain modules: `runs` (start and steer), `machine` (advance),
`outcomes` (a task's end), `payload` (what a task receives). A task's outcome is recorded in the
transaction that ends its job, by conditional UPDATEs of its task row and its stage's
counters; every other change to a run (starting stages, ending it) happens in one
transaction that first locks the run's row. Whoever brings a stage's `pending` to zero
queues the run's advance event, so the last tasks of a stage finishing at the same
instant in different processes advance the run once.
"""
from __future__ import annotations

from typing import Any

from django.apps import apps
from django.db import models
from django.db.models.functions import Coalesce

from leases.tasks.models.jobs import TRACEPARENT_LENGTH

NAME_LENGTH = 100
KEY_LENGTH = 255
TASK_LENGTH = 200


class RunStatus(models.TextChoices):
    """A run's status, named here once (and by these names in leases.pipelines.sql)."""

    RUNNING = "running", "running"
    PAUSED = "paused", "paused"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


class StageStatus(models.TextChoices):
    WAITING = "waiting", "waiting"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"


class TaskStatus(models.TextChoices):
    #: Not queued yet (a serial or max_parallel stage queues its tasks as others finish).
    WAITING = "waiting", "waiting"
    #: Its job waits or runs; the job's row says which.
    QUEUED = "queued", "queued"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"
    #: Never queued: its run ended first.
    SKIPPED = "skipped", "skipped"


def _steering() -> Any:
    """`leases.pipelines.runs`, which steers runs, as this app's config holds it: the
    models sit below the behaviour that changes them and import none of it."""
    return apps.get_app_config("leases_pipelines").runs


class RunQuerySet(models.QuerySet):
    def with_progress(self) -> RunQuerySet:
        """Annotate `tasks_done` and `tasks_total` from the runs' stages (a few rows per
        run, read through the stage's run index): the tasks made so far, as a for_each
        adds its items when its stage starts, and how many of them have finished."""
        stages = StageRun.objects.filter(run=models.OuterRef("pk")).order_by().values("run")

        def total(column: str) -> models.Func:
            summed = stages.annotate(n=models.Sum(column, output_field=models.IntegerField())).values("n")
            return Coalesce(models.Subquery(summed, output_field=models.IntegerField()), 0)

        return self.annotate(tasks_done=total("done"), tasks_total=total("total"))


class Run(models.Model):
    """One run of a pipeline, with the snapshot of the definition it was started with.

    `live_key` is a hash of (pipeline, key) while the run is live (running or paused)
    and NULL after: its unique index makes "one live run per key" structural. A run
    started without a key gets a random one, so a start whose reply was lost finds its
    own run again instead of starting a second.
    """

    RUNNING, PAUSED, SUCCEEDED, FAILED, CANCELLED = RunStatus
    STATUSES = RunStatus.choices
    LIVE = (RUNNING, PAUSED)

    pipeline = models.CharField(max_length=NAME_LENGTH)
    key = models.CharField(max_length=KEY_LENGTH, blank=True, default="")
    live_key = models.CharField(max_length=64, null=True, blank=True, unique=True)
    status = models.CharField(max_length=10, choices=STATUSES, default=RunStatus.RUNNING)
    definition = models.JSONField(help_text="The pipeline as it was when the run started.")
    context = models.JSONField(default=dict, blank=True)
    #: Run-level events received (`send_event`), by name: a stage with `wait_for` starts
    #: once its event is here.
    events = models.JSONField(default=dict, blank=True, db_default={})
    error = models.TextField(blank=True, default="")
    queued_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: Counts the engine's decisions about the run; each writes it, so that two of them on
    #: two nodes of a Galera cluster conflict (see store.locked).
    revision = models.PositiveBigIntegerField(default=0, editable=False)
    traceparent = models.CharField(
        max_length=TRACEPARENT_LENGTH, null=True, blank=True, editable=False,
        help_text="W3C trace context of the run's span (OpenTelemetry), which its tasks' jobs carry.",
    )

    objects = RunQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["status", "pipeline"], name="leases_pipe_run_status"),
            models.Index(fields=["pipeline", "key"], name="leases_pipe_run_key"),
            # Runs that ended before a time, for pruning (a live run's is NULL).
            models.Index(fields=["finished_at"], name="leases_pipe_run_finished"),
        ]
        verbose_name = "pipeline run"

    def __str__(self) -> str:
        return f"{self.pipeline} #{self.pk}" + (f" ({self.key})" if self.key else "")

    def cancel(self) -> bool:
        """Stop the run: nothing new starts, waiting tasks are cancelled.

        False if the run had ended already."""
        return _steering().cancel(self)

    def pause(self) -> bool:
        """Start nothing new until resume(); running tasks finish.

        False if it was paused already; ValueError for a run that has ended."""
        return _steering().pause(self)

    def resume(self) -> bool:
        """Let a paused run go on, starting what became due meanwhile.

        False if it was running already; ValueError for a run that has ended. It also
        records tasks whose jobs ended unnoticed, so it moves a run that looks stuck."""
        return _steering().resume(self)

    def send_event(self, name: str, data: object = None) -> bool:
        """Give the run the event `name` with its JSON `data`: a stage waiting for it
        starts. False if the run had it already (the first data stays); ValueError for a
        run that has ended."""
        return _steering().send_event(self, name, data)

    def wait(self, timeout: float = 60.0) -> Run:
        """The run, once it has ended (its status says how), waiting up to `timeout`
        seconds; TimeoutError if it is still live then."""
        return _steering().wait(self, timeout)

    def restart(self, stage: str) -> None:
        """Run a failed or cancelled stage again, then everything that depends on it."""
        _steering().restart(self, stage)

    def progress(self) -> tuple[int, int]:
        """(tasks finished, tasks made so far), as `with_progress` annotates them."""
        found = Run.objects.using(self._state.db).filter(pk=self.pk).with_progress()
        return found.values_list("tasks_done", "tasks_total").first() or (0, 0)


class StageRun(models.Model):
    """A stage of a run. `pending` counts its tasks not finished yet (the join), `waiting`
    those not queued yet (a serial or max_parallel stage queues them as others finish),
    `done` those finished."""

    WAITING, RUNNING, SUCCEEDED, FAILED, CANCELLED = StageStatus
    STATUSES = StageStatus.choices

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="stages")
    name = models.CharField(max_length=NAME_LENGTH)
    position = models.PositiveIntegerField(help_text="Place in the definition.")
    status = models.CharField(max_length=10, choices=STATUSES, default=StageStatus.WAITING)
    total = models.PositiveIntegerField(default=0)
    pending = models.PositiveIntegerField(default=0)
    waiting = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    failed_tasks = models.PositiveIntegerField(default=0)
    restarts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    queued_at = models.DateTimeField(null=True, blank=True, help_text="When its tasks were made.")
    started_at = models.DateTimeField(null=True, blank=True, help_text="When its first task started.")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "position"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="leases_pipe_stage_name")]
        verbose_name = "stage"

    def __str__(self) -> str:
        return self.name


class TaskRun(models.Model):
    """One task of a stage (one per item in a for_each stage) and the job that runs it.

    While its job waits or runs the task is "queued"; the job's own row says which.
    """

    WAITING, QUEUED, SUCCEEDED, FAILED, CANCELLED, SKIPPED = TaskStatus
    STATUSES = TaskStatus.choices
    FINISHED = (SUCCEEDED, FAILED, CANCELLED, SKIPPED)

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tasks")
    stage = models.ForeignKey(StageRun, on_delete=models.CASCADE, related_name="tasks")
    task = models.CharField(max_length=TASK_LENGTH, help_text="Handler name.")
    position = models.PositiveIntegerField(help_text="Order in the stage: item, then task.")
    item_index = models.PositiveIntegerField(null=True, blank=True)
    item = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=STATUSES, default=TaskStatus.WAITING)
    job_id = models.BigIntegerField(null=True, blank=True, unique=True, help_text="The job running it.")
    attempts = models.PositiveIntegerField(default=0)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["stage_id", "position"]
        indexes = [
            # The next waiting task of a stage, and how many of it are queued.
            models.Index(fields=["stage", "status", "position"], name="leases_pipe_task_next"),
        ]
        verbose_name = "task"

    def __str__(self) -> str:
        return f"{self.task}" + (f"[{self.item_index}]" if self.item_index is not None else "")
