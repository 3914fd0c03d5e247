"""The scoreboard: what the parent knows of the run, for the live table and the summary.

It learns from two sources only: the crawlers' messages (see `crawler.Reporter`) and
the pool's rows, polled with the database clock.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from typing import Any

from .crawler import Crawler
from .kills import Kill
from .proof import Use


class Scoreboard:
    """The crawlers' last known states, their confirmed uses and grants, the kills, the events."""

    def __init__(self, opts: argparse.Namespace, where: str, tty: bool) -> None:
        self.opts = opts
        self.where = where  # the database, for the header and the summary
        self.tty = tty  # a live table; otherwise events and status are printed as lines
        self.start = time.monotonic()
        self.crawlers: dict[int, Crawler] = {}
        self.uses: list[Use] = []
        self.granted: dict[tuple[str, int], int] = {}  # (proxy, token) -> the crawler it went to
        self.late = self.lost = 0
        self.kills: list[Kill] = []
        self.events: list[str] = []
        self.rows: list = []  # the pool's rows at the last poll
        self.now_db: datetime | None = None  # the database clock at the last poll
        self.tokens_at_start = 0

    def handle(self, msg: tuple) -> None:
        """Take in one crawler message; a killed crawler's state stays "killed"."""
        kind, cid, pid, *rest = msg
        c = self.crawlers[cid]
        alive = c.state != "killed"
        if kind == "use":
            self.uses.append(Use(cid, pid, *rest))
        elif kind == "lease":
            proxy, token, since, job_end = rest
            self.granted.setdefault((proxy, token), cid)
            if alive:
                c.state, c.proxy, c.token, c.since, c.job_end = "running", proxy, token, since, job_end
        elif kind == "late":
            self.late += 1
        elif kind == "lost":
            self.lost += 1
            if alive:
                c.state = "waiting"
        elif kind == "wait" and alive:
            c.state = "waiting"
        elif kind == "release" and alive:
            c.state, c.proxy, c.token = "idle", None, None
        elif kind == "exit" and alive:
            c.state = "exited"
        elif kind == "log":
            self.event(f"crawler {cid}: {rest[0]}")
        elif kind == "error":
            c.error = rest[0]
            c.state = "failed"
            self.event(f"crawler {cid} failed: {rest[0].strip().splitlines()[-1]}")

    def event(self, text: str) -> None:
        """Note something worth a line: under the live table, or printed at once."""
        line = f"{time.monotonic() - self.start:6.1f}s  {text}"
        self.events.append(line)
        if not self.tty:
            print(line, flush=True)

    def track_recoveries(self) -> None:
        """Follow each killed crawler's proxy in the rows of the last poll, until retaken."""
        rows: dict[str, Any] = {r.name: r for r in self.rows}
        for k in self.kills:
            if k.proxy is None or k.taken_token is not None or k.proxy not in rows:
                continue
            if k.follow(rows[k.proxy], self.now_db, self.granted):
                self.event(k.line())
