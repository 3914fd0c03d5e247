"""State of the lease engine. Behaviour lives in `leases.pool` and `leases.lease`."""
from __future__ import annotations

from datetime import datetime, timezone

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

#: busy_before of a resource nobody has held yet: long past, so it is free.
EPOCH = datetime(2000, 1, 1, tzinfo=timezone.utc)

POOL_NAME_LENGTH = 100
RESOURCE_NAME_LENGTH = 255
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
        indexes = [models.Index(fields=["pool", "busy_before"], name="leases_resource_free")]
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
