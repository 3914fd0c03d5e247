"""The worker's event loop for `async def` handlers: one per worker process, in a thread
of its own, started with the first async job. Each job is a task on it, counted in the
worker's concurrency like a thread's job, so a hundred handlers that await the network
cost the loop's thread and a few of its executor's, not a hundred (handler threads start
only when a plain job needs one).

What must not block the loop runs on its executor's threads: the runner's call (a
pipeline task reads its payload there), and the context's durable calls
(`ctx.astep`, `ctx.asleep`, `ctx.await_for`), which write to the database. A job given
up (past its timeout, or cancelled and still running past the grace) is cancelled, which
a coroutine, unlike a thread, allows.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue as stdqueue
import threading
import time

from django.db import connections

from .. import tracing
from ..context import context_for, running
from ..jobs import outcomes
from ..jobs.claim import ClaimedJob
from ..jobs.outcomes import Outcome

#: Seconds a stopping worker waits for its loop's thread to end.
STOP_WAIT = 12.0
#: Most threads of the loop's executor (durable calls and blocking steps of async handlers).
EXECUTOR_THREADS = 32


async def execute(job: ClaimedJob) -> Outcome:
    """Run one attempt of an async handler; whatever it does or returns becomes its
    outcome, except a cancellation of the worker's own (the job was given up)."""
    began = time.monotonic()
    spec = job.handler
    job.context = context_for(job, job.using)
    try:
        with tracing.running(job), running(job.context):
            pending = await asyncio.to_thread(spec.run, job)  # what reads the database before the handler
            value = await pending if inspect.isawaitable(pending) else pending
    except BaseException as exc:  # noqa: BLE001 - a handler must never kill the worker
        if isinstance(exc, asyncio.CancelledError) and job.abandoned:
            raise
        outcome = outcomes.raised(job, spec, exc)
    else:
        outcome = outcomes.returned(job, value)
    outcome.seconds = time.monotonic() - began
    return outcome


class EventLoop:
    """An asyncio loop in a thread, running async handlers' jobs; outcomes go to `done`."""

    def __init__(self, size: int, done: stdqueue.Queue) -> None:
        self.done = done
        self.loop = asyncio.new_event_loop()
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, min(size, EXECUTOR_THREADS)),
                                                              thread_name_prefix="leases-async")
        self.loop.set_default_executor(self.executor)
        self.running: dict[int, concurrent.futures.Future] = {}
        self.thread = threading.Thread(target=self._serve, name="leases-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self._close_connections()  # before the loop's close shuts its executor down
            self.loop.close()
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _close_connections(self) -> None:
        """Each executor thread closes the database connections it opened, as a handler
        thread does when it ends (else each stays open until the process exits): one call
        per thread, held at a barrier so no thread takes two; a thread still busy (a step
        of an abandoned handler) keeps its connection."""
        count = len(getattr(self.executor, "_threads", ()))
        if not count:
            return
        barrier = threading.Barrier(count)

        def close() -> None:
            connections.close_all()
            try:
                barrier.wait(timeout=5.0)
            except threading.BrokenBarrierError:
                pass

        try:
            concurrent.futures.wait([self.executor.submit(close) for _ in range(count)], timeout=10.0)
        except RuntimeError:  # the interpreter is exiting: its connections close with the process
            pass

    def submit(self, job: ClaimedJob) -> None:
        self.running[job.id] = asyncio.run_coroutine_threadsafe(self._run(job), self.loop)

    async def _run(self, job: ClaimedJob) -> None:
        try:
            self.done.put(await execute(job))
        except asyncio.CancelledError:
            pass  # given up: the worker wrote its outcome already
        except Exception as exc:  # noqa: BLE001 - building its context failed: the attempt did
            self.done.put(outcomes.failed(job, exc, retryable=True))
        finally:
            self.running.pop(job.id, None)

    def cancel(self, job: ClaimedJob) -> bool:
        """Cancel `job`'s attempt if it runs here; whether it did."""
        future = self.running.pop(job.id, None)
        if future is None:
            return False
        future.cancel()
        return True

    def stop(self) -> None:
        """Cancel what still runs and end the loop's thread, waiting a little for it to
        close its connections (a worker stops after its grace: what runs now is given up)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=STOP_WAIT)
