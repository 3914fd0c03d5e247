"""A job claimed by a worker without its handler goes to a worker that has it.

A worker lacks a handler during a rolling deploy, or when it was started without the
`--import` that defines it. Each worker's row lists the handlers it can run. A worker that
claims a job it cannot run gives it back without using a try (`outcomes`):

- at once when a live worker serving the job's queue has the handler;
- otherwise after BOUNCE_DELAY, noting the job in its row, so that a worker that starts
  with the handler takes the job at once (`take_over`) rather than after the delay. The
  job fails when no worker had its handler for LEASES_HANDLER_GRACE.

Either way it leaves that handler's jobs out of its own claims for BOUNCE_DELAY seconds,
so they reach a worker that has it instead of bouncing between those that do not.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from leases import db
from leases.sql import in_list

from .. import sql
from .outcomes import BOUNCE_DELAY, Outcome, describe

#: Seconds a process trusts what it read of the live workers' handlers.
ROSTER_TTL = 1.0
#: Jobs a worker notes in its row as handed back, at most (the newest).
NOTED = 200

_roster: dict[str, tuple[float, list[tuple[str, frozenset[str], frozenset[str]]]]] = {}
_roster_lock = threading.Lock()


def dumps(handlers: list[str]) -> str:
    """A worker row's `handlers`."""
    return json.dumps(sorted(handlers), separators=(",", ":"))


def _live(using: str, fresh: bool = False) -> list[tuple[str, frozenset[str], frozenset[str]]]:
    """(name, queues, handlers) of each live worker, as of at most ROSTER_TTL ago (now,
    with `fresh`)."""
    now = time.monotonic()
    with _roster_lock:
        cached = _roster.get(using)
    if cached and cached[0] > now and not fresh:
        return cached[1]

    def work(cursor: Any, resumed: bool) -> list[tuple]:
        cursor.execute(sql.workers(cursor.db).live_handlers, ())
        return cursor.fetchall()

    found = [(name, frozenset(queues.split(",")), frozenset(names(handlers)))
             for name, queues, handlers in db.run(work, using)]
    with _roster_lock:
        _roster[using] = (now + ROSTER_TTL, found)
    return found


def names(text: str) -> list[str]:
    """The names of a worker row's `handlers` (none when it holds no list)."""
    try:
        names = json.loads(text) if text else []
    except ValueError:
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def elsewhere(name: str, queue: str, worker: str, using: str, fresh: bool = False) -> bool:
    """Whether a live worker other than `worker` serves `queue` and has the handler `name`."""
    return any(other != worker and name in handlers and (queue in queues or "*" in queues)
               for other, queues, handlers in _live(using, fresh))


def note(worker: str, handed: dict[str, list[int]], using: str) -> dict[str, list[int]]:
    """Write the jobs `worker` handed back for later ({handler name: [job ids]}, newest
    name last) into its row, the newest NOTED of them; returns what it wrote."""
    kept: dict[str, list[int]] = {}
    room = NOTED
    for name, ids in reversed(list(handed.items())):
        if room <= 0:
            break
        kept[name] = ids[-room:]
        room -= len(kept[name])
    text = json.dumps(kept, separators=(",", ":"))
    db.run(lambda cursor, resumed: cursor.execute(sql.workers(cursor.db).note_handed_back, (text, worker)), using)
    return dict(reversed(list(kept.items())))


def take_over(handlers: list[str], queues: list[str], using: str) -> int:
    """Make due now the jobs other workers handed back for later whose handler is among
    `handlers` and whose queue among `queues` (["*"]: any); returns how many."""
    mine = set(handlers)

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.workers(cursor.db)
        cursor.execute(st.handed_back, ())
        ids: set[int] = set()
        for (text,) in cursor.fetchall():
            try:
                noted = json.loads(text)
            except ValueError:
                continue
            if isinstance(noted, dict):
                ids.update(int(i) for name, found in noted.items() if name in mine and isinstance(found, list)
                           for i in found if isinstance(i, int))
        if not ids:
            return 0
        jobs = sql.jobs(cursor.db)
        statement, params = jobs.take_over + in_list(ids), [*sorted(ids)]
        if queues != ["*"]:
            statement, params = statement + jobs.take_over_queues + in_list(queues), [*params, *queues]
        cursor.execute(statement, params)
        return cursor.rowcount

    return db.run(work, using)


def forget_roster() -> None:
    """Read the live workers again at the next question (tests)."""
    with _roster_lock:
        _roster.clear()


class Lacking:
    """What one worker does about the handlers it lacks: which handlers' jobs it leaves to
    others for now, and which jobs it handed back for later."""

    def __init__(self, using: str) -> None:
        self.using = using
        self._skip: dict[str, float] = {}
        self._handed: dict[str, list[int]] = {}

    def give_back(self, worker: str, job: Any, exc: BaseException) -> Outcome:
        """The outcome of a `job` claimed by `worker` whose handler is not here (`exc` says
        why). Either way the worker leaves that handler's jobs out of its claims for
        BOUNCE_DELAY: a worker that has it gets them, or takes over those handed back for
        later when it starts, without workers that lack it claiming them first."""
        there = elsewhere(job.name, job.queue, worker, self.using)
        if not there:  # a worker with it may have started within the roster's age
            there = elsewhere(job.name, job.queue, worker, self.using, fresh=True)
        self._skip[job.name] = time.monotonic() + BOUNCE_DELAY
        return Outcome(job, ok=False, error=describe(exc), bounce=True, elsewhere=there)

    def skipped(self) -> tuple[str, ...]:
        """Names of jobs to leave out of the next claim."""
        now = time.monotonic()
        self._skip = {name: until for name, until in self._skip.items() if until > now}
        return tuple(sorted(self._skip))

    def written(self, worker: str, outcomes: list[Outcome], written: dict[int, str]) -> None:
        """Note in `worker`'s row the jobs it just handed back for later."""
        later = [outcome.job for outcome in outcomes if written.get(outcome.job.id) == "bounced"]
        if not later:
            return
        for job in later:
            self._handed[job.name] = [*self._handed.pop(job.name, []), job.id]  # newest name last
        self._handed = note(worker, self._handed, self.using)
