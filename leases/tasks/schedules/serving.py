"""Which queue a schedule's jobs go on, and whether a live worker serves it.

A tick's job goes on the schedule's own `queue`; without one, on its handler's, or for
a pipeline's start on the queue of the pipeline's first tasks (leases.pipelines
registers how to find it), so the workers that do a schedule's work also start it and
no worker of another queue is needed. A process that does not know the handler or the
pipeline (defined in a module only other workers `--import`) cannot tell: the job then
goes on the queue of a handler's defaults, "default", and the leader says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leases import clock, routing

from .. import registry
from ..jobs.push import JobDefaults
from ..models import Worker


@dataclass(frozen=True)
class Place:
    """Where a schedule's jobs go: `queue`, and `why` that one, in an operator's words;
    `known` is False when this process had to fall back (see the module's docstring)."""

    queue: str
    why: str
    known: bool = True


def place(row: Any, using: str) -> Place:
    """Where the jobs of `row` (a Schedule, or a row a pass read) go when pushed on `using`."""
    if row.queue:
        return Place(row.queue, "the schedule's own")
    if row.handler:
        spec = registry.find(row.handler)
        if spec is None:
            return Place(JobDefaults.queue, f"handler {row.handler!r} is not registered in this process", False)
        return Place(spec.queue, "its handler's")
    target = registry.target("pipeline")
    queue = target.queue(row.pipeline)
    if queue is None:
        return Place(JobDefaults.queue, f"pipeline {row.pipeline!r} or its first task is not defined in this"
                     " process", False)
    elsewhere = routing.route("queues", queue)
    if elsewhere != using:
        return Place(JobDefaults.queue, f"the queue of its pipeline's first tasks, {queue!r}, is on database"
                     f" {elsewhere!r}", False)
    return Place(queue, "its pipeline's first tasks'")


def serving(queue: str, using: str) -> list[str]:
    """The live workers (by their rows, now by the database clock) that serve `queue`."""
    rows = Worker.objects.using(using).filter(expires_at__gt=clock.db_now(using)).values_list("name", "queues")
    return [name for name, queues in rows if {queue, "*"} & set(queues.split(","))]
