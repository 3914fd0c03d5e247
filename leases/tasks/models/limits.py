"""State of per-key limits: operators' rules by prefix, and a row per limited key whose
lock serialises decisions about it. Behaviour lives in `leases.tasks.jobs.limits`."""
from __future__ import annotations

from django.db import models

from .jobs import KEY_LENGTH


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
