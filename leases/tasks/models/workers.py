"""State of the `leases_worker` processes: one row each, held as a lease. Behaviour lives
in `leases.tasks.jobs.recovery` (the row's protocol) and `leases.tasks.worker` (the process)."""
from __future__ import annotations

from django.db import models

from .dispatch import WORKER_LENGTH


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
    #: The handlers it can run (a JSON list of names), so a worker that lacks one hands
    #: their jobs to it at once (`leases.tasks.jobs.handoff`).
    handlers = models.TextField(blank=True, default="")
    #: Jobs it handed back while no live worker had their handler (JSON {name: [ids]}, the
    #: newest few): a worker that has one takes them when it starts, not after their delay.
    handed_back = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["name"]
        verbose_name = "queue worker"

    def __str__(self) -> str:
        return self.name
