"""State of the work dispatcher. Behaviour lives in `leases.tasks.dispatcher`."""
from __future__ import annotations

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


class TaskState(models.IntegerChoices):
    """Where a dispatcher's task is: in the pool, in one worker's bucket, or done."""

    POOL = 0, "pool"
    BUCKET = 1, "bucket"
    DONE = 2, "done"


class PoolTask(models.Model):
    """A task id of a dispatcher: in the pool, in one worker's bucket, or done.

    One row per (dispatcher, value) is what makes the invariants structural: a task can
    be in at most one bucket, never in a bucket and the pool at once.
    """

    POOL, BUCKET, DONE = TaskState
    STATES = TaskState.choices

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
