"""State of schedules: recurring and one-off jobs and pipeline runs, and the runs they
fired. Behaviour lives in `leases.tasks.schedules`."""
from __future__ import annotations

from django.db import models

from leases.validation import QUEUE_LENGTH

from .dispatch import NAME_LENGTH
from .jobs import JOB_NAME_LENGTH


class Schedule(models.Model):
    """A recurring (cron, every) or one-off (at) job or pipeline run. Behaviour lives in
    `leases.tasks.schedules`; the leader among the workers fires due ticks.

    `next_fire_at` is the next tick by the database clock (NULL once a one-off fired, or
    while disabled), and the leader's claim of it: it fires a tick in the transaction
    that moves it on, with the schedule's row locked. `fires` numbers the runs.
    """

    LAST, NONE, ALL = "last", "none", "all"
    CATCH_UP = [
        (LAST, "last: one run for the ticks missed"),
        (NONE, "none: skip missed ticks"),
        (ALL, "all: every missed tick (at most 1,000)"),
    ]
    API, SETTINGS = "api", "settings"
    SOURCES = [(API, "api"), (SETTINGS, "settings")]  # schedule() or the admin; LEASES_SCHEDULES

    name = models.CharField(max_length=NAME_LENGTH, unique=True)
    handler = models.CharField(max_length=JOB_NAME_LENGTH, blank=True, help_text="The job's handler, or:")
    pipeline = models.CharField(max_length=NAME_LENGTH, blank=True, help_text="The pipeline a tick starts.")
    cron = models.CharField(max_length=NAME_LENGTH, blank=True, help_text="Cron expression, in `timezone`.")
    every = models.FloatField(null=True, blank=True, help_text="Seconds between ticks.")
    at = models.DateTimeField(null=True, blank=True, help_text="The one tick of a one-off.")
    timezone = models.CharField(max_length=64, help_text="Time zone of the cron expression.")
    payload = models.JSONField(default=dict, blank=True, help_text="The job's payload, or the run's context.")
    queue = models.CharField(max_length=QUEUE_LENGTH, blank=True, help_text="Blank: the handler's queue.")
    priority = models.SmallIntegerField(default=0)
    enabled = models.BooleanField(default=True)
    catch_up = models.CharField(max_length=4, choices=CATCH_UP, default=LAST)
    source = models.CharField(max_length=8, choices=SOURCES, default=API)
    next_fire_at = models.DateTimeField(null=True, blank=True)
    last_fire_at = models.DateTimeField(null=True, blank=True)
    fires = models.PositiveIntegerField(default=0, help_text="Runs fired so far.")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["name"]
        indexes = [
            # The leader's pass: due ticks of enabled schedules, soonest first.
            models.Index(fields=["enabled", "next_fire_at"], name="leases_schedule_due"),
        ]

    def __str__(self) -> str:
        return self.name


class RunStatus(models.TextChoices):
    """How a schedule's run ended, copied from its job (by these names in the SQL of
    leases.tasks.sql). `status` keeps its plain column: naming its choices on the field
    would need a migration for nothing."""

    QUEUED = "queued", "queued"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    DEAD = "dead", "dead"
    CANCELLED = "cancelled", "cancelled"
    #: Its job was deleted while it waited.
    DISCARDED = "discarded", "discarded"


class ScheduleRun(models.Model):
    """One run fired by a schedule: its tick (NULL for a run fired by hand), the job, and
    how the job ended (recorded by the statement that ends it). A schedule keeps its
    newest LEASES_KEEP_RUNS runs. (schedule, tick) is unique: one job per tick, whatever
    two leaders overlapping do."""

    QUEUED = RunStatus.QUEUED

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="runs")
    number = models.PositiveIntegerField(help_text="1 for the schedule's first run.")
    tick_at = models.DateTimeField(null=True, blank=True, help_text="Empty: fired by hand.")
    fired_at = models.DateTimeField()
    job_id = models.BigIntegerField(null=True, blank=True, unique=True)
    status = models.CharField(max_length=10, default="queued")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["schedule", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "tick_at"], name="leases_schedule_run_tick"),
            models.UniqueConstraint(fields=["schedule", "number"], name="leases_schedule_run_number"),
        ]
        verbose_name = "schedule run"

    def __str__(self) -> str:
        return f"run #{self.number}"
