"""The worker's handler threads: each runs one claimed job at a time and hands back its
outcome. Whatever a handler does or returns becomes an outcome; nothing it raises, however
odd, reaches the worker's loop."""
from __future__ import annotations

import queue as stdqueue
import threading
import time
from typing import Any

from django.db import connections

from .. import registry, tracing
from ..context import context_for, running
from ..jobs import outcomes
from ..jobs.claim import ClaimedJob
from ..jobs.outcomes import Outcome, failed
from . import kept
from .aio import EventLoop


def handler_for(job: ClaimedJob) -> Any:
    """What runs `job`: a registered handler, an app's runner for its backend (pipelines),
    or the Django Tasks backend named by its TASKS alias."""
    if job.backend:
        factory = registry.runner(job.backend)
        if factory is not None:
            return factory(job)
        from ..backend import task_handler  # the Tasks framework is optional

        return task_handler(job)
    return registry.get(job.name)


def execute(job: ClaimedJob) -> Outcome:
    """Run one attempt; whatever the handler does or returns becomes its outcome. The
    thread's database connections are kept for the next one (see `kept`)."""
    kept.before_job()
    began = time.monotonic()
    try:
        outcome = _attempt(job)
        outcome.seconds = time.monotonic() - began
        return outcome
    finally:
        kept.after_job()


def _attempt(job: ClaimedJob) -> Outcome:
    try:
        spec = job.handler or handler_for(job)
    except Exception as exc:  # noqa: BLE001 - e.g. a task path that is not a task
        return failed(job, exc, retryable=False)
    job.context = context_for(job, job.using)
    try:
        with tracing.running(job), running(job.context):
            value = spec.run(job)
    except BaseException as exc:  # noqa: BLE001 - a handler must never kill the worker
        return outcomes.raised(job, spec, exc)
    return outcomes.returned(job, value)


class Threads:
    """Up to `size` threads running handlers, each started when a job finds none free, so
    a worker of async handlers keeps few; a timed-out job's thread is given up (it exits
    when its handler finally returns) and its place goes to a new one. Async handlers run
    on one event loop beside them, started with the first. Outcomes go to `done`."""

    def __init__(self, size: int, done: stdqueue.Queue) -> None:
        self.work: stdqueue.SimpleQueue = stdqueue.SimpleQueue()
        self.done = done
        self.size = size
        self.loop: EventLoop | None = None
        self._lock = threading.Lock()
        self._started = 0  # threads serving `work`, those given up left out
        self._running: set[int] = set()  # jobs handed to them and not ended
        self._given_up: set[int] = set()

    def _loop(self) -> None:
        try:
            while (job := self.work.get()) is not None:
                self.done.put(execute(job))
                with self._lock:
                    if job.id in self._given_up:
                        self._given_up.discard(job.id)
                        return  # its place went to another thread
                    self._running.discard(job.id)
        finally:
            connections.close_all()

    def submit(self, job: ClaimedJob) -> None:
        if getattr(job.handler, "is_async", False):
            if self.loop is None:
                self.loop = EventLoop(self.size, self.done)
            self.loop.submit(job)
            return
        with self._lock:
            self._running.add(job.id)
            wanted = len(self._running) > self._started
            self._started += wanted
        if wanted:
            threading.Thread(target=self._loop, name="leases-job", daemon=True).start()
        self.work.put(job)

    def abandon(self, job: ClaimedJob) -> None:
        """Give up a running attempt (marked abandoned): an async one is cancelled; a
        thread cannot be, so it is left to end on its own and no longer counts."""
        if self.loop is not None and self.loop.cancel(job):
            return
        with self._lock:
            if job.id in self._running:  # else its thread ended it meanwhile and serves on
                self._running.discard(job.id)
                self._given_up.add(job.id)
                self._started -= 1

    def stop(self) -> None:
        """Let each thread end once it is idle; cancel what still runs on the loop."""
        with self._lock:
            started = self._started
        for _ in range(started):
            self.work.put(None)
        if self.loop is not None:
            self.loop.stop()
