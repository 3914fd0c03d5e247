"""State of durable handlers, beside the job rows: each completed step's result (and each
sleep's or wait's), and the events sent to jobs. Behaviour lives in
`leases.tasks.jobs.steps` and `leases.tasks.context`."""
from __future__ import annotations

from django.db import models

from .jobs import Job

#: Longest step and event names.
STEP_NAME_LENGTH = 200


class JobStep(models.Model):
    """One step of a durable job, by its place in the handler (`seq`, from 1): its name,
    and its JSON result once it completed. A sleep or a wait is a step too: begun (`done`
    false, with when it ends), then done (a wait's event data, or its timeout). Written in
    short transactions fenced by the job's claim; kept with the job, deleted with it."""

    job = models.ForeignKey(Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="steps")
    seq = models.PositiveIntegerField()
    name = models.CharField(max_length=STEP_NAME_LENGTH)
    result = models.JSONField(null=True, blank=True)
    done = models.BooleanField(default=True)
    #: A sleep's or a wait's end (its timeout), by the database clock; None for none.
    until = models.DateTimeField(null=True, blank=True)
    at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="leases_job_step")]
        ordering = ["job", "seq"]
        verbose_name = "job step"

    def __str__(self) -> str:
        return f"step {self.seq} {self.name}"


class JobEvent(models.Model):
    """An event sent to a job (`send_event`): kept until a wait of its name takes it, so
    an event sent before the wait is not lost; each wait takes exactly one (`taken_seq`,
    the step that took it)."""

    job = models.ForeignKey(Job, on_delete=models.DO_NOTHING, db_constraint=False, related_name="events")
    name = models.CharField(max_length=STEP_NAME_LENGTH)
    data = models.JSONField(null=True, blank=True)
    sent_at = models.DateTimeField()
    taken_seq = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        # A job's events of a name, oldest first: what a wait takes.
        indexes = [models.Index(fields=["job", "name", "taken_seq", "id"], name="leases_job_event")]
        ordering = ["job", "id"]
        verbose_name = "job event"

    def __str__(self) -> str:
        return f"event {self.name} for job {self.job_id}"
