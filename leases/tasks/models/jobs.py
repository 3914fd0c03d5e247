"""State of the job queue: queues, jobs and their failed attempts. A job's life is
behaviour, in `leases.tasks.jobs`, one module per stage."""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.apps import apps
from django.core.validators import MinValueValidator
from django.db import models

from leases.validation import POOL_NAME_LENGTH, QUEUE_LENGTH, TARGET_LENGTH

from .dispatch import WORKER_LENGTH

JOB_NAME_LENGTH = 200
#: Dedupe keys; 255 utf8mb4 characters fit an InnoDB unique index.
KEY_LENGTH = 255
PRIORITY_RANGE = (-100, 100)
#: A W3C traceparent of version 00 ("00-<trace id>-<span id>-<flags>").
TRACEPARENT_LENGTH = 55
#: The longest affinity key of a job (leases.tasks.needs).
AFFINITY_LENGTH = 255


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


class JobStatus(models.IntegerChoices):
    """A job's status: named here once, and by these names in the SQL of leases.tasks.sql."""

    READY = 0, "ready"
    RUNNING = 1, "running"
    SUCCEEDED = 2, "succeeded"
    FAILED = 3, "failed"
    DEAD = 4, "dead"
    CANCELLED = 5, "cancelled"
    #: Held back by its key's concurrency, off the claim's index range (ready again when
    #: a job of the key stops running).
    BLOCKED = 6, "blocked"


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


    def deconstruct(self) -> Any:
        """The path the migrations know it by (its module became a package's part)."""
        name, _, args, kwargs = super().deconstruct()
        return name, "leases.tasks.models.JobStatusField", args, kwargs


class Job(models.Model):
    """One job of the delayed queue. Behaviour lives in `leases.tasks.jobs`.

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

    READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED, BLOCKED = JobStatus
    STATUSES = JobStatus.choices
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
    status = JobStatusField(choices=STATUSES, default=JobStatus.READY)
    attempt = models.PositiveIntegerField(default=0, help_text="Tries used so far (of max attempts).")
    max_attempts = models.PositiveIntegerField(default=1)
    claims = models.PositiveIntegerField(default=0, help_text="Times claimed by a worker; fences outcomes.")
    pushes = models.PositiveIntegerField(default=1, help_text="Pushes merged into this job by its key.")
    # The random ids of the push that made it and of the last one merged into it: a push
    # whose reply was lost finds by them what its statement did (see jobs.push).
    push_id = models.BigIntegerField(null=True, blank=True, editable=False, help_text="Id of the push that made it.")
    merged_push_id = models.BigIntegerField(null=True, blank=True, editable=False,
                                            help_text="Id of the last push merged into it.")
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
    traceparent = models.CharField(
        max_length=TRACEPARENT_LENGTH, null=True, blank=True, editable=False,
        help_text="W3C trace context of its push (OpenTelemetry), the parent of its runs' spans.",
    )
    # A job that holds a resource while it runs (leases.tasks.jobs.leasing): the pool it
    # needs ('' for none), its target and affinity keys, its turn among its pool's jobs
    # (targets take turns when resources are scarce; 0 for a job of no pool), and while
    # it runs the resource row it holds and that lease's fencing token.
    pool = models.CharField(max_length=POOL_NAME_LENGTH, blank=True, default="",
                            help_text="The pool whose resource it holds while it runs.")
    target = models.CharField(max_length=TARGET_LENGTH, blank=True, default="",
                              help_text="Bans, rests and pace of resources count per target (a site).")
    affinity = models.CharField(max_length=AFFINITY_LENGTH, blank=True, default="",
                                help_text="Jobs of one affinity key run on the resource they last used.")
    turn = models.BigIntegerField(default=0, help_text="Its place among its pool's jobs: targets take turns.")
    resource_id = models.BigIntegerField(null=True, blank=True, help_text="The resource row its attempt holds.")
    lease_token = models.BigIntegerField(null=True, blank=True, help_text="That lease's fencing token.")
    # A durable job (leases.tasks.jobs.steps): what a suspended job waits for ("sleep", or
    # "event:" and the event's name, up to 200 characters; '' once claimed), and when an
    # operator asked its running attempt to stop.
    waiting_for = models.CharField(max_length=210, blank=True, default="", db_default="",
                                   help_text="What a suspended durable job waits for: 'sleep' or 'event:<name>'.")
    cancel_requested_at = models.DateTimeField(null=True, blank=True,
                                               help_text="When cancelling its running attempt was asked.")

    class Meta:
        indexes = [
            # The claim: one queue's ready rows, highest priority first, then oldest run_at,
            # then id. Running rows share the prefix, so recovery and heartbeats scan only
            # those. The id is named: InnoDB appends it to every index anyway, PostgreSQL
            # does not, and without it each claim sorts every ready row of its queue.
            # Jobs that need a resource are a lane of their own in each queue, taken in
            # turns (`turn` is 0 for the others, so their order is unchanged).
            models.Index(fields=["status", "queue", "pool", "-priority", "turn", "run_at", "id"],
                         name="leases_job_claim"),
            # Pruning by age, and keeping the last runs of a key.
            models.Index(fields=["finished_at"], name="leases_job_finished"),
            models.Index(fields=["key", "finished_at"], name="leases_job_key"),
            # A key's running jobs (its concurrency), and its blocked ones in claim order.
            models.Index(fields=["limit_key", "status", "-priority", "run_at", "id"], name="leases_job_limit"),
            # A key's starts within its rate's window.
            models.Index(fields=["limit_key", "started_at"], name="leases_job_limit_starts"),
        ]

    def __str__(self) -> str:
        return f"{self.name} #{self.pk}"

    def wait(self, timeout: float = 60.0) -> Any:
        """Its handler's result once it succeeded, waiting up to `timeout` seconds; JobFailed
        if it ended otherwise, TimeoutError if it has not ended (see leases.tasks.wait)."""
        return apps.get_app_config("leases_tasks").results.wait(self, timeout)

    @classmethod
    def describe(cls, status: int, attempt: int, expires_at: datetime | None, now: datetime,
                 waiting_for: str = "") -> str:
        """The status as operators read it, `now` by the database clock: a ready job that
        used tries awaits a retry; a durable one sleeps or waits for an event; a running
        one whose lease lapsed lost its worker (the next recovery puts it back)."""
        if status == cls.READY and waiting_for:  # a durable job, suspended (maybe after a retry)
            return "sleeping" if waiting_for == "sleep" else f"waiting for {waiting_for.removeprefix('event:')!r}"
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
