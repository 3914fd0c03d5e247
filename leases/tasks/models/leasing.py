"""State of jobs that hold resources, beside the job rows: which resource an affinity
key's jobs last used, and the turns targets take when a pool's resources are scarce.
Behaviour lives in `leases.tasks.jobs.leasing`."""
from __future__ import annotations

from django.db import models

from leases.validation import POOL_NAME_LENGTH, QUEUE_LENGTH, RESOURCE_NAME_LENGTH, TARGET_LENGTH

from .jobs import AFFINITY_LENGTH


class Affinity(models.Model):
    """The resource the jobs of one affinity key (a login session) last ran on: the next
    runs there too while it is usable."""

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    affinity = models.CharField(max_length=AFFINITY_LENGTH, help_text="The affinity key (KEY is reserved in MySQL).")
    name = models.CharField(max_length=RESOURCE_NAME_LENGTH, help_text="The resource's name.")
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "affinity"], name="leases_affinity_key")]
        verbose_name_plural = "affinities"

    def __str__(self) -> str:
        return f"{self.pool}: {self.affinity} -> {self.name}"


class PoolTurn(models.Model):
    """The last turn given to a target's jobs in one queue's lane of a pool: a new job of
    the target takes the next, or the lane's current one if that is later, so targets
    take turns in the claim's order (start-time fair queueing, by counters)."""

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    queue = models.CharField(max_length=QUEUE_LENGTH)
    target = models.CharField(max_length=TARGET_LENGTH, blank=True, default="")
    last_turn = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["pool", "queue", "target"], name="leases_pool_turn")]

    def __str__(self) -> str:
        return f"{self.pool}/{self.queue}: {self.target or '-'} at {self.last_turn}"
