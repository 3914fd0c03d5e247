"""The resource a running job holds, as its handler sees it (`ctx.lease`).

Its own module because both the handler's context and the claim that pairs a job with a
free resource make one: the claim must not reach back up into the context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leases.exceptions import LeaseLost


@dataclass
class JobLease:
    """The resource a running job holds: claimed with the job, renewed by its worker's
    heartbeat, released when the attempt ends. `token` is the fencing token: it grows with
    every acquisition of the resource, so a system that remembers the highest it has seen
    can refuse a stale holder."""

    pool: str
    name: str
    slot: int
    data: Any
    token: int
    id: int
    holder: str
    #: Set by the worker when a renewal failed (the resource was released, quarantined or
    #: removed by an operator): the job no longer holds it.
    lost: bool = False

    def check(self) -> None:
        """LeaseLost if the job no longer holds its resource."""
        if self.lost:
            raise LeaseLost(f"job's lease on {self.pool}/{self.name} (token {self.token}) was lost")
