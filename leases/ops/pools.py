"""The base app's part of the dashboard and the metrics: resource pools (slots by state,
fencing tokens) and named locks, each one grouped query by the caller's database clock.
Both need the view permission of resources (the locks held are one count beside them)."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db.models import Count, Q, Sum

from leases import db
from leases.models import Lock, Resource, ResourceTarget

from .charts import BLUE, GREEN, ORANGE, RED, Panel, Row, count, nothing, rows_chart
from .links import changelist
from .readings import needs

#: What a viewer needs to see the pools' panel and metrics, and the list it links to.
VIEW, RESOURCES = "leases.view_resource", "leases.resource"

#: A pool's bar shows its states in this order, in the admin's colours.
STATE_COLOURS = {
    Resource.HELD: ORANGE, Resource.COOLING: BLUE, Resource.QUARANTINED: RED, Resource.FREE: GREEN,
}


def resources_by_pool(now: datetime, using: str | None = None) -> dict[str, dict[str, int]]:
    """Per pool: slots by state (as Pool.stats judges them) and `tokens`, the sum of its
    fencing tokens. One grouped query that reads every slot row: pools hold thousands of
    slots, not the millions of rows the job and task tables may."""
    busy = Q(busy_before__gt=now)
    quarantined = Q(quarantined_until__gt=now)
    rows = (
        Resource.objects.using(db.alias(using)).order_by("pool").values("pool").annotate(
            total=Count("*"),
            quarantined=Count("pk", filter=quarantined),
            held=Count("pk", filter=busy & ~Q(holder="") & ~quarantined),
            cooling=Count("pk", filter=busy & Q(holder="") & ~quarantined),
            tokens=Sum("token"),
        )
    )
    return {
        row["pool"]: {
            Resource.FREE: row["total"] - row["held"] - row["cooling"] - row["quarantined"],
            Resource.HELD: row["held"],
            Resource.COOLING: row["cooling"],
            Resource.QUARANTINED: row["quarantined"],
            "tokens": int(row["tokens"] or 0),
        }
        for row in rows
    }


#: Targets the bans metric names one by one.
BANS_SHOWN = 50


def locks_held(now: datetime, using: str | None = None) -> int:
    """One count over the lock table, a row per lock name ever used."""
    return Lock.objects.using(db.alias(using)).filter(expires_at__gt=now).count()


def pools(now: datetime, using: str) -> Panel:
    """Each pool's slots as shares of the pool: pools of 5 and 5,000 read alike. A pool
    links to its resources in the admin, a state to those in that state."""
    rows = []
    for pool, counts in resources_by_pool(now, using).items():
        segments = [(state, colour, counts[state]) for state, colour in STATE_COLOURS.items()]
        note = " · ".join(count(n, state) for state, _, n in segments if n)
        links = {state: changelist(RESOURCES, using, pool__exact=pool, state=state)
                 for state in STATE_COLOURS}
        rows.append(Row(pool, segments, f"{note} of {sum(n for _, _, n in segments):,}",
                        changelist(RESOURCES, using, pool__exact=pool), links))
    if not rows:
        return Panel("Resource pools", nothing("No resources yet."))
    return Panel("Resource pools", rows_chart(f"Slots of {len(rows)} pool(s) by state", rows, shares=True))


@needs(VIEW)
def pool_panels(now: datetime, using: str) -> list[Panel]:
    """The pools' panel: one query."""
    return [pools(now, using)]


@needs(VIEW)
def lease_metrics(now: datetime, using: str) -> Iterator[Any]:
    """Slots by state and fencing tokens per pool, and locks held: two queries."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    resources = GaugeMetricFamily(
        "leases_resources", "Resource slots per pool by state, by the database clock.",
        labels=["pool", "state"],
    )
    acquisitions = CounterMetricFamily(
        "leases_lease_acquisitions",
        "Sum of the pool's fencing tokens: leases acquired, plus evictions and quarantines, which"
        " bump the token too. It drops when resources are removed.",
        labels=["pool"],
    )
    for pool, counts in resources_by_pool(now, using).items():
        for state in Resource.STATES:
            resources.add_metric([pool, state], counts[state])
        acquisitions.add_metric([pool], counts["tokens"])
    yield resources
    yield acquisitions
    yield GaugeMetricFamily("leases_locks_held", "Named locks held now.", value=locks_held(now, using))
    bans = GaugeMetricFamily(
        "leases_resource_bans", f"Resources a target bans now, per pool and target (the {BANS_SHOWN} targets with"
        " the most; the rest summed as target '(other)').", labels=["pool", "target"],
    )
    for (pool, target), banned in bans_by_target(now, using).items():
        bans.add_metric([pool, target], banned)
    yield bans


def bans_by_target(now: datetime, using: str | None = None) -> dict[tuple[str, str], int]:
    """Resources banned now per (pool, target), the BANS_SHOWN targets with the most and
    the rest as "(other)": a grouped read of the rows of bans (one per resource and target)."""
    rows = (ResourceTarget.objects.using(db.alias(using)).filter(banned_until__gt=now)
            .values_list("pool", "target").annotate(n=Count("*")).order_by("-n", "pool", "target"))
    found: dict[tuple[str, str], int] = {}
    for index, (pool, target, banned) in enumerate(rows):
        key = (pool, target) if index < BANS_SHOWN else (pool, "(other)")
        found[key] = found.get(key, 0) + banned
    return found
