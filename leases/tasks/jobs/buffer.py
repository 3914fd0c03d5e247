"""The buffer of a full queue (its `when_full` is "buffer"): jobs it refused, kept in the
pushing process and written as room appears.

A daemon thread retries them and drops (with an error in the log) what is still here after
the queue's full_timeout. They live in memory only: a job buffered when the process exits
is lost, which `atexit` reports. Each buffered batch keeps the push id it was given (see
`push.insert`) for all its tries, so a try whose reply was lost is found by the next one
rather than written twice.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from django.db import connections

from . import queues

log = logging.getLogger("leases.tasks")


@dataclass
class _Held:
    """A batch the queue refused: its jobs, until when, and its push id; `unsure` once a
    try failed after it may have written them."""

    deadline: float
    queue: queues.QueueSettings
    jobs: Sequence[Any]
    using: str
    count: int
    push_id: int
    unsure: bool = False


class Buffer:
    """Jobs a full queue refused, written by `insert(jobs, using, push_id, unsure)`."""

    def __init__(self, insert: Callable[[Sequence[Any], str, int, bool], None]) -> None:
        self._insert = insert
        self._items: deque[_Held] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        atexit.register(self._report)

    def add(self, queue: queues.QueueSettings, jobs: Sequence[Any], using: str, count: int, push_id: int) -> None:
        with self._lock:
            self._items.append(_Held(time.monotonic() + queue.full_timeout, queue, list(jobs), using, count, push_id))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="leases-push-buffer", daemon=True)
                self._thread.start()
            self._lock.notify_all()
        log.warning("queue %s is full: %d job(s) buffered in this process", queue.name, len(jobs))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(item.jobs) for item in self._items)

    def wait_empty(self, timeout: float) -> bool:
        """Block until the buffer is empty (written or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _report(self) -> None:
        left = len(self)
        if left:
            log.error("exiting with %d buffered job(s) not pushed", left)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._items:
                        return
                    item = self._items[0]
                if not self._try(item):
                    time.sleep(0.2)
        finally:
            connections.close_all()

    def _try(self, item: _Held) -> bool:
        queue = item.queue
        try:
            room = queues.has_room(queues.queue_settings(queue.name, item.using), item.count, item.using)
            if room:
                unsure, item.unsure = item.unsure, True  # a try that fails may have written them
                self._insert(item.jobs, item.using, item.push_id, unsure)
        except Exception:
            log.exception("buffered push to queue %s failed; will retry", queue.name)
            room = False
        if not room and time.monotonic() < item.deadline:
            return False
        if not room:
            self.dropped += len(item.jobs)
            log.error(
                "dropped %d buffered job(s) of queue %s: still full after %.0fs (first: %s)",
                len(item.jobs), queue.name, queue.full_timeout, item.jobs[0].name,
            )
        with self._lock:
            self._items.popleft()
            self._lock.notify_all()
        return True
