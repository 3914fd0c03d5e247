"""Jobs counted by queue, as operators read them: `manage.py jobs stats`, and the line a
`--burst` worker leaves when jobs wait on queues it does not serve.

Each count is one grouped read over the claim index's status prefix (what ended lately:
the finished_at index), never a walk of the whole table. Jobs of internal handlers (an
app's bookkeeping, such as a pipeline's advance event: `registry.internal_names`) are
counted apart from operators' work, so neither hides in the other.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Min, Q, Value

from leases import db
from leases.clock import db_now

from .. import registry
from ..models import Job
from .steps import EVENT, SLEEPING

#: The window of the finished counts.
RECENT = timedelta(hours=1)
#: The counts of each queue, and of the internal jobs.
FIELDS = ("ready", "blocked", "running", "due", "oldest", "succeeded", "failed", "dead")
#: The statuses of jobs not finished.
LIVE = ("ready", "blocked", "running")
#: What `by_queue` calls the internal jobs of every queue together.
INTERNAL = "(internal)"
#: The prefix of their counts in the grouped reads.
_APART = "internal_"


def by_queue(now: datetime, queue: str | None = None, using: str | None = None) -> dict[str, dict[str, Any]]:
    """Per queue (one queue: `queue`), operators' jobs: ready, blocked, running, due (ready
    and their time come), the oldest due time, and succeeded, failed and dead within
    RECENT of `now`; under INTERNAL the same of internal jobs, all queues together.

    Three reads, grouped by queue alone: grouped by (queue, status), SQLite walks the whole
    claim index to skip sorting the groups. Internal jobs are told apart by conditional
    counts in the same reads, so they cost no read of their own."""
    jobs = Job.objects.using(db.alias(using)).order_by()
    if queue is not None:
        jobs = jobs.filter(queue=queue)
    names = sorted(registry.internal_names())
    sides = {"": ~Q(name__in=names), _APART: Q(name__in=names)} if names else {"": Q()}
    # The jobs not finished, a part a status: an equality on the claim index's first
    # column, which SQLite plans as a search although the name test reads each row (for an
    # IN list of statuses it walks the table). Each row: queue, status, counts by side.
    live = [jobs.filter(status=status).values("queue").annotate(
        status_=Value(status), **_counts(sides, n=Q())) for status in LIVE]
    oldest = {f"{side}oldest": Min("run_at", filter=apart) for side, apart in sides.items()}
    due = jobs.filter(status="ready", run_at__lte=now).values("queue").annotate(
        **_counts(sides, due=Q()), **oldest)
    recent = jobs.filter(finished_at__gte=now - RECENT).values("queue").annotate(**_counts(
        sides, succeeded=Q(status="succeeded"), failed=Q(status="failed"), dead=Q(status="dead")))
    found: dict[str, dict[str, Any]] = {}
    for row in live[0].union(*live[1:], all=True):
        status = row.pop("status_")
        named = {"n": status, f"{_APART}n": f"{_APART}{status}"}
        _merge(found, {named.get(key, key): value for key, value in row.items()})
    for row in (row for part in (due, recent) for row in part):
        _merge(found, row)
    if INTERNAL in found and not any(found[INTERNAL][field] for field in FIELDS if field != "oldest"):
        del found[INTERNAL]
    return found


def _merge(found: dict[str, dict[str, Any]], row: dict[str, Any]) -> None:
    """Add the counts of one queue's row to its queue's, and its internal ones to INTERNAL's."""
    queue_name = row.pop("queue")
    for key, value in row.items():
        side = INTERNAL if key.startswith(_APART) else queue_name
        _add(found.setdefault(side, _empty()), key.removeprefix(_APART), value)


def _counts(sides: dict[str, Q], **tests: Q) -> dict[str, Count]:
    """A count per test and side, named side + test ("ready", "internal_ready")."""
    return {f"{side}{field}": Count("pk", filter=test & apart) for side, apart in sides.items()
            for field, test in tests.items()}


def _empty() -> dict[str, Any]:
    return dict.fromkeys(FIELDS, 0) | {"oldest": None}


def _add(counts: dict[str, Any], field: str, value: Any) -> None:
    """Add a count of one queue's group to `counts`; the oldest time is the earliest."""
    if field == "oldest":
        counts[field] = min((time for time in (counts[field], value) if time is not None), default=None)
    else:
        counts[field] += value


def due_elsewhere(queues: list[str], using: str | None = None) -> dict[str, int]:
    """How many jobs are due (ready, their time come) on each queue not in `queues`:
    one grouped read, for a worker that found nothing to do in its own."""
    using = db.alias(using)
    rows = (Job.objects.using(using).order_by().filter(status="ready", run_at__lte=db_now(using))
            .exclude(queue__in=queues).values_list("queue").annotate(n=Count("pk")))
    return dict(rows)


def suspended(using: str | None = None) -> dict[str, dict[str, int]]:
    """Per queue, durable jobs suspended: "sleeping", and "waiting" for an event. One
    grouped read of the ready rows (the claim index's status prefix), as `by_queue`'s."""
    rows = (Job.objects.using(db.alias(using)).order_by().filter(status="ready").exclude(waiting_for="")
            .values("queue").annotate(sleeping=Count("pk", filter=Q(waiting_for=SLEEPING)),
                                      waiting=Count("pk", filter=Q(waiting_for__startswith=EVENT))))
    return {row.pop("queue"): row for row in rows}
