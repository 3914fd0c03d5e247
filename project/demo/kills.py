"""The SIGKILLs: when the demo kills crawlers, and how their proxies come back.

A crawler killed while it holds a proxy never releases it: the database lets the lease
go when it runs out, and a waiting crawler takes the proxy with the next fencing token.
A `Kill` follows one such proxy from the kill to its next holder.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .crawler import crawler_of

#: Extra time a killed crawler's proxy may take to come back, beyond its ttl.
RECOVERY_SLACK = 0.5


def kill_window(opts: argparse.Namespace) -> tuple[float, float]:
    """When kills may happen: after the crowd settled, early enough to see the recovery."""
    return max(0.2 * opts.seconds, min(opts.ttl, 2.0)), opts.seconds - opts.ttl - 2.0


def min_seconds(opts: argparse.Namespace) -> float:
    """The shortest --seconds for which `kill_window` is not empty."""
    return max((opts.ttl + 2.0) / 0.8, opts.ttl + 2.0 + min(opts.ttl, 2.0))


def kill_times(opts: argparse.Namespace) -> list[float]:
    """When to kill, in seconds into the run: --kills instants spread over `kill_window`."""
    first, last = kill_window(opts)
    return [first + (last - first) * (i + 0.5) / opts.kills for i in range(opts.kills)]


@dataclass
class Kill:
    """One SIGKILL, and what became of the proxy the crawler held (if it held one)."""

    crawler: int
    at: float  # seconds into the run
    at_db: datetime
    proxy: str | None = None
    token: int | None = None
    expires: datetime | None = None  # the dead lease's busy_before
    freed_after: float | None = None  # seconds from the kill until the database let it go
    taken_by: int | None = None
    taken_token: int | None = None
    taken_after: float | None = None
    early: bool = False  # taken before the dead lease ran out: must never happen

    def follow(self, row: Any, now_db: datetime, granted: dict[tuple[str, int], int]) -> bool:
        """Learn from the proxy's row at `now_db`; True once the proxy was granted again."""
        from leases.models import Resource

        if row.token == self.token:
            if row.busy_before > self.expires:  # a renewal was in flight when it died
                self.expires = row.busy_before
            if row.state_at(now_db) != Resource.HELD and self.freed_after is None:
                self.freed_after = (self.expires - self.at_db).total_seconds()
            return False
        # The token moved on: the engine granted the proxy again.
        self.freed_after = (self.expires - self.at_db).total_seconds()
        self.taken_token = self.token + 1
        self.taken_by = granted.get((self.proxy, self.taken_token))
        if row.token == self.taken_token and row.acquired_at is not None:
            self.taken_after = (row.acquired_at - self.at_db).total_seconds()
            self.early = row.acquired_at < self.expires
            if self.taken_by is None:
                self.taken_by = crawler_of(row.holder)
        else:  # granted more than once since the last look: an upper bound
            self.taken_after = (now_db - self.at_db).total_seconds()
        return True

    def line(self) -> str:
        """The event shown as the proxy comes back."""
        head = f"crawler {self.crawler} killed holding {self.proxy} (token {self.token})"
        if self.freed_after is None:
            return head + "; not free yet"
        text = f"{head}; {self.proxy} free again after {self.freed_after:.1f}s"
        if self.taken_token is None:
            return text + ", nobody took it yet"
        return text + f", now held by {self.taken_by_name()} (token {self.taken_token})"

    def taken_by_name(self) -> str:
        return f"crawler {self.taken_by}" if self.taken_by is not None else "another holder"

    def row(self) -> str:
        """Its row in the summary's table of kills."""
        freed = "-" if self.freed_after is None else f"{self.freed_after:.1f}s"
        taken = "-" if self.taken_after is None else f"{self.taken_after:.1f}s"
        by = "-" if self.taken_token is None else f"{self.taken_by_name()} (#{self.taken_token})"
        crawler = f"crawler {self.crawler}"
        return f"{self.proxy:<10}#{self.token:<6}{crawler:<12}{self.at:9.1f}s{freed:>12}{taken:>10}   {by}"


def recovery_problems(holding: list[Kill], opts: argparse.Namespace) -> list[str]:
    """What went wrong with the kills of crawlers holding a proxy: each must come back in time."""
    problems = []
    for k in holding:
        if k.freed_after is None:
            problems.append(f"{k.proxy} of killed crawler {k.crawler} never came back")
        elif k.freed_after > opts.ttl + RECOVERY_SLACK:
            problems.append(f"{k.proxy} came back {k.freed_after:.1f}s after the kill, more than the ttl")
        if k.early:
            problems.append(f"{k.proxy} was granted again before the killed crawler's lease ran out")
    if len(holding) < opts.kills:
        problems.append(f"only {len(holding)} of {opts.kills} kills hit a crawler holding a proxy")
    return problems
