"""State of the lease engine. Behaviour lives in `leases.pool` and `leases.lease`."""
from __future__ import annotations

from datetime import datetime, timezone

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from .choices import VerdictKind
from .validation import POOL_NAME_LENGTH, RESOURCE_NAME_LENGTH, TARGET_LENGTH

#: busy_before of a resource nobody has held yet: long past, so it is free.
EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)

HOLDER_LENGTH = 255


class Resource(models.Model):
    """One slot of a leasable thing (a proxy, an account) in a named pool: a resource of
    N slots is N rows of one name, numbered from 0, each leased on its own.

    A slot is busy while `busy_before` is in the future by the database clock: held
    while it also has a holder, cooling down (rested after a release) while it has none.
    Quarantine pushes `busy_before` forward too, so "free" is one index range scan:
    ``pool = ? AND busy_before <= now``, in the order slots came free. `token` is the
    fencing token: it grows with every acquisition (and every forced change of holder)
    and never goes back.
    """

    FREE, HELD, COOLING, QUARANTINED = "free", "held", "cooling", "quarantined"
    STATES = (FREE, HELD, COOLING, QUARANTINED)

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    name = models.CharField(max_length=RESOURCE_NAME_LENGTH)
    slot = models.PositiveSmallIntegerField(default=0, help_text="0 to slots - 1.")
    data = models.JSONField(default=dict, blank=True, encoder=DjangoJSONEncoder)
    busy_before = models.DateTimeField(default=EPOCH)
    holder = models.CharField(max_length=HOLDER_LENGTH, blank=True, default="")
    token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    quarantined_until = models.DateTimeField(null=True, blank=True)
    quarantine_reason = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "name", "slot"], name="leases_resource_slot")
        ]
        # The longest free first, ties by id: the claim's order, read straight from the
        # index on every vendor (InnoDB appends the id by itself; PostgreSQL would sort).
        indexes = [models.Index(fields=["pool", "busy_before", "id"], name="leases_resource_free")]
        ordering = ["pool", "name", "slot"]

    def __str__(self) -> str:
        return f"{self.pool}/{self.name}" + (f" slot {self.slot}" if self.slot else "")

    def state_at(self, now: datetime) -> str:
        """free, held, cooling or quarantined at `now`, which must come from the database clock."""
        if self.quarantined_until is not None and self.quarantined_until > now:
            return self.QUARANTINED
        if self.busy_before > now:
            return self.HELD if self.holder else self.COOLING
        return self.FREE


class ResourceTarget(models.Model):
    """A resource as one target (a site, a domain) sees it: banned until when and why,
    rested until when (a cool-down, such as a `Retry-After`), and when its next start
    for that target may come (a pace). Per resource name, all its slots: a site bans an
    address, not a slot. A resource one target bans stays usable for the others; taking it
    out for everyone is a quarantine (`Resource.quarantined_until`), the operator's.

    Behaviour lives in `leases.targets`; jobs that hold resources (`leases.tasks`) and the
    Scrapy middleware read and write the same rows.
    """

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    name = models.CharField(max_length=RESOURCE_NAME_LENGTH)
    target = models.CharField(max_length=TARGET_LENGTH)
    banned_until = models.DateTimeField(null=True, blank=True)
    ban_reason = models.CharField(max_length=255, blank=True, default="")
    rested_until = models.DateTimeField(null=True, blank=True)
    next_start_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            # Also the read of a target's rows for a few resources: (pool, target, name).
            models.UniqueConstraint(fields=["pool", "target", "name"], name="leases_resource_target"),
        ]
        indexes = [
            models.Index(fields=["pool", "name"], name="leases_target_of_resource"),
            models.Index(fields=["banned_until"], name="leases_target_banned"),  # the bans in force
        ]
        ordering = ["pool", "name", "target"]

    def __str__(self) -> str:
        return f"{self.pool}/{self.name} for {self.target}"

    def state_at(self, now: datetime) -> str:
        """banned, rested, paced or usable for its target at `now` (the database clock)."""
        for state, until in (("banned", self.banned_until), ("rested", self.rested_until),
                             ("paced", self.next_start_at)):
            if until is not None and until > now:
                return state
        return "usable"


class Verdict(models.Model):
    """One line of the history of what targets said of a resource: a ban or a rest, with
    who said it (a spider's or a job's holder; `job` when a job of the queue did), and the
    operators' lifts. `ResourceTarget` holds what is in force; this keeps how it came to
    be, so "why is site X stuck?" and "which bans did job #45 meet?" have answers after the
    fact. Paces are not logged: one comes with every start."""

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    name = models.CharField(max_length=RESOURCE_NAME_LENGTH)
    target = models.CharField(max_length=TARGET_LENGTH)
    kind = models.CharField(max_length=4, choices=VerdictKind.choices)
    reason = models.CharField(max_length=255, blank=True, default="")
    until = models.DateTimeField(null=True, blank=True, help_text="When the ban or rest ends; none for a lift.")
    at = models.DateTimeField()
    holder = models.CharField(max_length=HOLDER_LENGTH, blank=True, default="", help_text="Who said it.")
    job = models.BigIntegerField(null=True, blank=True, help_text="The job of the queue whose attempt said it.")

    class Meta:
        indexes = [
            models.Index(fields=["pool", "target", "at"], name="leases_verdict_target"),
            models.Index(fields=["pool", "name", "at"], name="leases_verdict_resource"),
            models.Index(fields=["job"], name="leases_verdict_job"),
            models.Index(fields=["at"], name="leases_verdict_at"),  # pruning
        ]
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.pool}/{self.name} {self.get_kind_display()} for {self.target}"


class Waiter(models.Model):
    """A caller waiting for a resource with `fair=True`: served in the order of `id`.

    Its ticket lives while the waiter renews it; one whose waiter died lapses within
    TICKET_TTL and stops holding up the others.
    """

    pool = models.CharField(max_length=POOL_NAME_LENGTH)
    holder = models.CharField(max_length=HOLDER_LENGTH)
    expires_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["pool", "id"], name="leases_waiter_order")]

    def __str__(self) -> str:
        return f"{self.pool}: {self.holder}"


class Lock(models.Model):
    """A named mutex with an expiry, created on first use and kept when released.

    Keeping the row is what lets `token` (the fencing token) grow across holders.
    Held while `expires_at` is in the future by the database clock.
    """

    name = models.CharField(max_length=255, unique=True)
    holder = models.CharField(max_length=HOLDER_LENGTH, blank=True, default="")
    token = models.BigIntegerField(default=0)
    expires_at = models.DateTimeField(default=EPOCH)
    acquired_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def held_at(self, now: datetime) -> bool:
        """Whether the lock is held at `now`, which must come from the database clock."""
        return self.expires_at > now
