"""State of the work dispatcher. Behaviour lives in `leases.tasks.dispatcher`."""
from __future__ import annotations

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
        verbose_name = "task"

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
        verbose_name = "dispatch worker"

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

    READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED = range(6)
    STATUSES = [
        (READY, "ready"),
        (RUNNING, "running"),
        (SUCCEEDED, "succeeded"),
        (FAILED, "failed"),
        (DEAD, "dead"),
        (CANCELLED, "cancelled"),
    ]
    FINISHED = (SUCCEEDED, FAILED, DEAD, CANCELLED)

    queue = models.CharField(max_length=QUEUE_LENGTH)
    name = models.CharField(max_length=JOB_NAME_LENGTH, help_text="Handler name, or the task's module path.")
    #: '' for a native handler job; otherwise the TASKS alias of a Django Tasks job.
    backend = models.CharField(max_length=QUEUE_LENGTH, blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    key = models.CharField(max_length=KEY_LENGTH, db_column="dedupe_key")
    pending_key = models.CharField(max_length=KEY_LENGTH, null=True, blank=True, unique=True)
    priority = models.SmallIntegerField(default=0)
    run_at = models.DateTimeField()
    status = models.SmallIntegerField(choices=STATUSES, default=READY)
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
        ]

    def __str__(self) -> str:
        return f"{self.name} #{self.pk}"


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
