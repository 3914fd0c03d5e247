"""Instant wake-up: a thread that listens for pushes to the worker's queues.

On PostgreSQL a push's commit notifies channel `leases_jobs` with each queue it filled
(`leases.tasks.jobs.push.announce`). This thread LISTENs on a connection of its own and,
for a queue the worker serves, wakes the loop, which claims at once instead of at its
next poll. It never claims or writes anything: a notification lost with a dropped
connection only delays a job to the next poll, which stays the fallback. While the
connection is down the loop polls at its usual pace, and the thread reconnects with
jittered backoff, saying so in one line when it loses the connection and one when it
listens again. Jobs due later (a delay, a retry's backoff) are found by the polls.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from django.db import Error, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from leases import db

from ..jobs.push import CHANNEL

log = logging.getLogger("leases.tasks.worker")

#: Seconds between two looks at whether the worker is stopping, while nothing comes.
STOP_CHECK = 1.0
#: Longest pause between two tries to listen again after the connection was lost.
RECONNECT_CAP = 5.0


class Wakeup(threading.Thread):
    """Calls `wake()` when jobs are pushed to one of `queues` (["*"]: any) on `using`."""

    def __init__(self, name: str, using: str, queues: Sequence[str], wake: Callable[[], None]) -> None:
        super().__init__(name=f"{name} wake-up", daemon=True)
        self.worker = name
        self.using = using
        self.queues = None if list(queues) == ["*"] else set(queues)
        self.wake = wake
        #: Set while a connection listens: the loop may then poll less often.
        self.listening = threading.Event()
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        connection = connections[self.using]
        try:
            self._serve(connection)
        finally:
            self.listening.clear()
            db.close(connection)

    def _serve(self, connection: BaseDatabaseWrapper) -> None:
        lost_at: float | None = None
        attempt = 0
        while not self._stop_event.is_set():
            try:
                if not db.listen(connection, CHANNEL):
                    return  # no notifications here: the loop polls
                if lost_at is not None:
                    log.info("worker %s: listening for pushes again after %.0fs", self.worker,
                             time.monotonic() - lost_at)
                elif attempt == 0:
                    log.info("worker %s: listening for pushes (LISTEN %s): they wake it at once", self.worker, CHANNEL)
                lost_at, attempt = None, 1
                self.listening.set()
                self.wake()  # pushes made while nobody listened were not heard: look now
                self._relay(connection)
            except Error as exc:
                self.listening.clear()
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("worker %s: lost its listen connection, polling until it is back: %s",
                                self.worker, db.one_line(exc))
                db.close(connection)
                attempt += 1
                self._stop_event.wait(db.backoff(attempt, base=0.1, cap=RECONNECT_CAP))

    def _relay(self, connection: BaseDatabaseWrapper) -> None:
        while not self._stop_event.is_set():
            payloads = db.notifications(connection, STOP_CHECK)
            if any(self.queues is None or queue in self.queues for queue in payloads):
                self.wake()
