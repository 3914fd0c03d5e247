"""Queues: their settings (paused, bounded), read by every worker and pusher, and what a
push to a full queue does (reject, wait, or leave the job to the pushing process's buffer).

A queue's row is made the first time a job is pushed to it, so the admin lists it; a
process trusts its copy of a queue's settings for SETTINGS_TTL seconds.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from django.db import connections

from leases import conf, db
from leases.exceptions import QueueFull

from .. import registry, sql
from ..models import Queue

#: Seconds a process trusts its copy of a queue's settings.
SETTINGS_TTL = 1.0


@dataclass(frozen=True)
class QueueSettings:
    name: str
    paused: bool = False
    max_length: int | None = None
    when_full: str = Queue.REJECT
    full_timeout: float = 30.0


_settings: dict[tuple[str, str], tuple[float, QueueSettings]] = {}
_settings_lock = threading.Lock()


def known_queues(using: str | None = None) -> set[str]:
    """Queues jobs may go to: those with a row, a handler's, or a Tasks backend's."""
    names = set(all_queues(using)) | {spec.queue for spec in registry.registered().values()}
    return names | conf.tasks_queues()


def queue_settings(name: str, using: str | None = None, create: bool = True) -> QueueSettings:
    """A queue's settings as of at most SETTINGS_TTL ago; the row is made on first use.

    With `create`, a queue nobody declared (no row, no handler or Tasks backend names it)
    is a ValueError: a misspelt queue would otherwise hold jobs no worker serves.
    """
    using = db.alias(using)
    now = time.monotonic()
    with _settings_lock:
        cached = _settings.get((using, name))
    if cached and cached[0] > now:
        return cached[1]
    row = db.run(_queue_row(name), using)
    if row is None and create:
        known = known_queues(using)
        if name not in known:
            raise ValueError(
                f"unknown queue {name!r} (known: {', '.join(sorted(known)) or 'none'}); name it in a"
                " handler or TASKS, or add it as a Queue row"
            )
        if not connections[using].in_atomic_block:
            db.run(_add_queue(name), using)
    found = QueueSettings(name, *row) if row else QueueSettings(name)
    with _settings_lock:
        _settings[(using, name)] = (now + SETTINGS_TTL, found)
    return found


def _queue_row(name: str) -> Callable[[Any, bool], tuple | None]:
    def work(cursor: Any, resumed: bool) -> tuple | None:
        cursor.execute(sql.jobs(cursor.db).queue_settings, (name,))
        return cursor.fetchone()

    return work


def _add_queue(name: str) -> Callable[[Any, bool], None]:
    defaults = QueueSettings(name)

    def work(cursor: Any, resumed: bool) -> None:
        cursor.execute(sql.jobs(cursor.db).add_queue, (name, defaults.paused, defaults.when_full, defaults.full_timeout))

    return work


def all_queues(using: str | None = None) -> dict[str, QueueSettings]:
    """Every queue with a row (all queues ever pushed to), by name."""

    def work(cursor: Any, resumed: bool) -> list[tuple]:
        cursor.execute(sql.jobs(cursor.db).all_queues, ())
        return cursor.fetchall()

    return {row[0]: QueueSettings(*row) for row in db.run(work, using)}


def forget_settings() -> None:
    """Drop the cached queue settings (after an operator changed them in this process)."""
    with _settings_lock:
        _settings.clear()


def has_room(queue: QueueSettings, count: int, using: str | None = None) -> bool:
    """Whether `count` more waiting jobs fit under the queue's max_length.

    Reads at most max_length index entries. Racing pushers may overshoot the bound by
    the jobs they push at the same moment: the bound is a brake, not a constraint.
    """
    if queue.max_length is None:
        return True
    offset = queue.max_length - count
    if offset < 0:
        return False

    def work(cursor: Any, resumed: bool) -> bool:
        cursor.execute(sql.jobs(cursor.db).queue_holds, (queue.name, offset))
        return cursor.fetchone() is None

    return db.run(work, using)


def make_room(queue: QueueSettings, count: int, using: str) -> bool:
    """A full queue's policy for `count` more jobs: True once there is room (when_full
    "wait", within full_timeout), False when they go to the pushing process's buffer
    ("buffer"); QueueFull otherwise."""
    if queue.when_full == Queue.WAIT:
        deadline = time.monotonic() + queue.full_timeout
        pause = 0.05
        while time.monotonic() < deadline:
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            if has_room(queue, count, using):
                return True
            pause = min(pause * 2, 1.0)
    elif queue.when_full == Queue.BUFFER:
        return False
    raise QueueFull(f"queue {queue.name!r} holds its max_length of {queue.max_length} waiting jobs")
