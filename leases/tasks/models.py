"""State of the work dispatcher. Behaviour lives in `leases.tasks.dispatcher`."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.validators import MinValueValidator
from django.db import models

NAME_LENGTH = 100
WORKER_LENGTH = 255
#: (dispatcher, value) is unique; 100 + 512 utf8mb4 characters fit InnoDB's 3072-byte key.
VALUE_LENGTH = 512


class TaskPool(models.Model):
    """One dispatcher: its name, and the bookkeeping of pool rebuilds.

    `generation` grows with every rebuild; task rows carry the generation of the last
    rebuild that listed them, so what a rebuild did not list can be dropped afterwards.
    """

    name = models.CharField(max_length=NAME_LENGTH, unique=True)
    generation = models.BigIntegerField(default=0)
    rebuild_started_at = models.DateTimeField(null=True, blank=True)
    rebuilt_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "dispatcher"

    def __str__(self) -> str:
        return self.name


class PoolTask(models.Model):
    """A task id of a dispatcher: in the pool, in one worker's bucket, or done.

    One row per (dispatcher, value) is what makes the invariants structural: a task can
    be in at most one bucket, never in a bucket and the pool at once.
    """

    POOL, BUCKET, DONE = 0, 1, 2
    STATES = [(POOL, "pool"), (BUCKET, "bucket"), (DONE, "done")]

    dispatcher = models.CharField(max_length=NAME_LENGTH)
    value = models.CharField(max_length=VALUE_LENGTH)
    score = models.FloatField()
    state = models.SmallIntegerField(choices=STATES, default=POOL)
    worker = models.CharField(max_length=WORKER_LENGTH, null=True, blank=True)
    seen = models.BigIntegerField(default=0)
    assigned_at = models.DateTimeField(null=True, blank=True)
    done_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dispatcher", "value"], name="leases_tasks_task_value")
        ]
        indexes = [
            # The claim: lowest score first among one dispatcher's pool rows.
            models.Index(fields=["dispatcher", "state", "score", "id"], name="leases_tasks_task_claim"),
            # A worker's bucket.
            models.Index(fields=["dispatcher", "worker", "state"], name="leases_tasks_task_bucket"),
        ]
        verbose_name = "dispatcher task"

    def __str__(self) -> str:
        return f"{self.dispatcher}/{self.value}"


class DispatchWorker(models.Model):
    """The router's entry for one worker: its bucket is the tasks that name it."""

    dispatcher = models.CharField(max_length=NAME_LENGTH)
    name = models.CharField(max_length=WORKER_LENGTH)
    last_seen = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["dispatcher", "name"], name="leases_tasks_worker_name")
        ]
        ordering = ["dispatcher", "name"]
        verbose_name = "dispatcher worker"

    def __str__(self) -> str:
        return f"{self.dispatcher}/{self.name}"


QUEUE_LENGTH = 100
JOB_NAME_LENGTH = 200
#: Dedupe keys; 255 utf8mb4 characters fit an InnoDB unique index.
KEY_LENGTH = 255
PRIORITY_RANGE = (-100, 100)


class Queue(models.Model):
    """Settings of one job queue, read by every worker and pusher (cached about a second).

    A row is created the first time a job is pushed to a queue, so the admin lists it.
    """

    REJECT, WAIT, BUFFER = "reject", "wait", "buffer"
    WHEN_FULL = [
        (REJECT, "reject: push raises QueueFull"),
        (WAIT, "wait: push blocks up to full_timeout, then raises QueueFull"),
        (BUFFER, "buffer: keep it in the pushing process, retry, drop after full_timeout"),
    ]

    name = models.CharField(max_length=QUEUE_LENGTH, unique=True)
    paused = models.BooleanField(default=False, help_text="Workers claim nothing from a paused queue.")
    max_length = models.PositiveIntegerField(
        null=True, blank=True, help_text="Jobs waiting before push follows 'when full'; empty for no bound."
    )
    when_full = models.CharField(max_length=10, choices=WHEN_FULL, default=REJECT)
    full_timeout = models.FloatField(
        default=30.0, validators=[MinValueValidator(0.0)], help_text="Seconds 'wait' blocks and 'buffer' keeps a job before giving up."
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class JobStatusField(models.SmallIntegerField):
    """A status stored as its number and also named by its label in queries and saves:
    filter(status="failed") and status__in=["ready", "blocked"] work, so callers need not
    know the numbers; numbers, and digit strings (the admin's ?status__exact=4), work too."""

    def get_prep_value(self, value: Any) -> Any:
        if isinstance(value, str):
            numbers = {label: number for number, label in self.choices}
            if value in numbers:
                return numbers[value]
            try:
                return super().get_prep_value(value)
            except ValueError:
                raise ValueError(
                    f"unknown job status {value!r}: use one of {', '.join(numbers)} (or its number)"
                ) from None
        return super().get_prep_value(value)


class Job(models.Model):
    """One job of the delayed queue. Behaviour lives in `leases.tasks.queue` and `.worker`.

    `pending_key` is the dedupe key while the job waits for its first run and NULL after:
    its unique index makes "one waiting job per key" structural, and a second push of the
    key an upsert that moves `run_at` and `priority` and counts `pushes`. `claims` grows
    with every claim and fences the outcome: a late finisher whose attempt was recovered
    and re-run writes nothing. `attempt` counts the tries that count against
    `max_attempts`: a worker's graceful hand-back, or one that lacks the handler, gives
    the try back (`attempt` goes down; `claims` never does). When a job with `on_finish`
    ends for good (succeeded, failed, dead, cancelled, or discarded while waiting), the
    statement that ends it also queues an `on_finish` job whose payload names it: how
    pipelines learn that a task finished, with no window in which a crash loses it.
    """

    READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED, BLOCKED = range(7)
    STATUSES = [
        (READY, "ready"),
        (RUNNING, "running"),
        (SUCCEEDED, "succeeded"),
        (FAILED, "failed"),
        (DEAD, "dead"),
        (CANCELLED, "cancelled"),
        (BLOCKED, "blocked"),
    ]
    FINISHED = (SUCCEEDED, FAILED, DEAD, CANCELLED)
    #: Not started yet: ready, or blocked by its key's concurrency (ready again when a
    #: job of the key ends).
    WAITING = (READY, BLOCKED)

    queue = models.CharField(max_length=QUEUE_LENGTH)
    name = models.CharField(max_length=JOB_NAME_LENGTH, help_text="Handler name, or the task's module path.")
    #: '' for a native handler job; otherwise the TASKS alias of a Django Tasks job.
    backend = models.CharField(max_length=QUEUE_LENGTH, blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    key = models.CharField(max_length=KEY_LENGTH, db_column="dedupe_key")
    pending_key = models.CharField(max_length=KEY_LENGTH, null=True, blank=True, unique=True)
    priority = models.SmallIntegerField(default=0)
    run_at = models.DateTimeField()
    status = JobStatusField(choices=STATUSES, default=READY)
    attempt = models.PositiveIntegerField(default=0, help_text="Tries used so far (of max attempts).")
    max_attempts = models.PositiveIntegerField(default=1)
    claims = models.PositiveIntegerField(default=0, help_text="Times claimed by a worker; fences outcomes.")
    pushes = models.PositiveIntegerField(default=1, help_text="Pushes merged into this job by its key.")
    bounced_at = models.DateTimeField(
        null=True, blank=True, help_text="When a worker without its handler first gave it back."
    )
    on_finish = models.CharField(
        max_length=JOB_NAME_LENGTH, blank=True, default="",
        help_text="Handler of a job queued, in the same transaction, when this one ends for good.",
    )
    worker = models.CharField(max_length=WORKER_LENGTH, blank=True, default="")
    limit_key = models.CharField(max_length=KEY_LENGTH, blank=True, default="",
                                 help_text="Jobs of one key share its concurrency and rate limits.")
    concurrency = models.PositiveIntegerField(null=True, blank=True, help_text="Jobs of its key running at once.")
    rate = models.CharField(max_length=20, blank=True, default="", help_text="Starts of its key per period: 10/m.")
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="Lease of the running attempt; renewed by its worker's heartbeat."
    )
    result = models.JSONField(null=True, blank=True)
    enqueued_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # The claim: one queue's ready rows, highest priority first, then oldest run_at.
            # Running rows share the prefix, so recovery and heartbeats scan only those.
            models.Index(fields=["status", "queue", "-priority", "run_at"], name="leases_job_claim"),
            # Pruning by age, and keeping the last runs of a key.
            models.Index(fields=["finished_at"], name="leases_job_finished"),
            models.Index(fields=["key", "finished_at"], name="leases_job_key"),
            # A key's running jobs (its concurrency), and its blocked ones in claim order.
            models.Index(fields=["limit_key", "status", "-priority", "run_at"], name="leases_job_limit"),
            # A key's starts within its rate's window.
            models.Index(fields=["limit_key", "started_at"], name="leases_job_limit_starts"),
        ]

    def __str__(self) -> str:
        return f"{self.name} #{self.pk}"

    @classmethod
    def describe(cls, status: int, attempt: int, expires_at: datetime | None, now: datetime) -> str:
        """The status as operators read it, `now` by the database clock: a ready job that
        used tries awaits a retry; a running one whose lease lapsed lost its worker (the
        next recovery puts it back)."""
        if status == cls.READY and attempt:
            return "awaiting retry"
        if status == cls.RUNNING and expires_at is not None and expires_at <= now:
            return "running, lease lapsed"
        return dict(cls.STATUSES).get(status, str(status))


class JobError(models.Model):
    """What one failed attempt raised (or that its worker was lost)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="errors")
    attempt = models.PositiveIntegerField()
    exception = models.CharField(max_length=255, help_text="Class path of the exception.")
    message = models.TextField(blank=True)
    traceback = models.TextField(blank=True)
    worker = models.CharField(max_length=WORKER_LENGTH, blank=True)
    at = models.DateTimeField()

    class Meta:
        ordering = ["job", "attempt"]
        verbose_name = "job error"

    def __str__(self) -> str:
        return f"{self.exception} (attempt {self.attempt})"


class Worker(models.Model):
    """A `leases_worker` process: a row it holds as a lease and renews with its heartbeat.

    Renewing after expiry fails, as for any lease; a worker that finds its lease gone
    registers again under a new name, since its running jobs may have been recovered.
    """

    name = models.CharField(max_length=WORKER_LENGTH, unique=True)
    holder = models.CharField(max_length=WORKER_LENGTH, blank=True)
    token = models.BigIntegerField(default=1)
    queues = models.CharField(max_length=1000)
    concurrency = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["name"]
        verbose_name = "queue worker"

    def __str__(self) -> str:
        return self.name


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


class ScheduleRun(models.Model):
    """One run fired by a schedule: its tick (NULL for a run fired by hand), the job, and
    how the job ended (recorded by the statement that ends it). A schedule keeps its
    newest LEASES_KEEP_RUNS runs. (schedule, tick) is unique: one job per tick, whatever
    two leaders overlapping do."""

    QUEUED = "queued"

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="runs")
    number = models.PositiveIntegerField(help_text="1 for the schedule's first run.")
    tick_at = models.DateTimeField(null=True, blank=True, help_text="Empty: fired by hand.")
    fired_at = models.DateTimeField()
    job_id = models.BigIntegerField(null=True, blank=True, unique=True)
    status = models.CharField(max_length=10, default=QUEUED)
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


class LimitRule(models.Model):
    """Limits for the jobs whose key starts with `prefix` (the longest prefix wins), set by
    an operator without a deploy; they override the handler's and the push's."""

    prefix = models.CharField(max_length=KEY_LENGTH, unique=True, help_text="e.g. 'example.com' or 'api:'.")
    concurrency = models.PositiveIntegerField(null=True, blank=True, help_text="Running at once; empty: no limit.")
    rate = models.CharField(max_length=20, blank=True, default="", help_text="Starts per period, e.g. 10/m.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["prefix"]
        verbose_name = "key limit"

    def __str__(self) -> str:
        return self.prefix


class LimitKey(models.Model):
    """One row per key that has been limited: the lock that makes the decisions about the
    key (who may start, who waits) one at a time across workers. Each decision counts
    itself here, so that it writes the row (which Galera certifies) as well as locking it."""

    name = models.CharField(max_length=KEY_LENGTH, unique=True)
    decisions = models.PositiveBigIntegerField(default=0, editable=False)

    class Meta:
        ordering = ["name"]
        verbose_name = "limited key"

    def __str__(self) -> str:
        return self.name
