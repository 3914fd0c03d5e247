"""The handlers of bench/durable.py, in a module of their own so the bench's
`manage.py leases_worker` processes import them (`--import bench.durable_handlers`)
without running the bench. All serve one queue, QUEUE; each does as little as it can
besides the durable call it measures, so the bench measures the queue and the steps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from leases.tasks.context import JobContext
from leases.tasks.registry import handler

QUEUE = "bench-durable"


@handler("bench.durable.plain", queue=QUEUE, max_attempts=1)
def plain(payload: Any) -> None:
    """A no-op job: the queue's own cost, beside which a step's is read."""
    return None


def _nothing(n: int) -> int:
    return n


@handler("bench.durable.steps", queue=QUEUE, max_attempts=1)
def stepped(payload: dict, ctx: JobContext) -> dict:
    """`payload["k"]` steps of nothing, each stored with the job; returns the handler's own
    milliseconds (the steps' writes and the load of the job's stored steps)."""
    began = time.perf_counter()
    for n in range(payload["k"]):
        ctx.step("nothing", _nothing, n)
    return {"ms": (time.perf_counter() - began) * 1000}


@handler("bench.durable.sleeper", queue=QUEUE, max_attempts=1)
def sleeper(payload: dict, ctx: JobContext) -> None:
    """One durable sleep of `payload["s"]` seconds, then done."""
    ctx.sleep(payload["s"])


@handler("bench.durable.waiter", queue=QUEUE, max_attempts=1)
def waiter(payload: dict, ctx: JobContext) -> Any:
    """Wait for the event "go" (ten minutes at most) and return its data."""
    return ctx.wait_for("go", timeout=600)


@handler("bench.durable.async", queue=QUEUE, max_attempts=1)
async def napper(payload: dict) -> None:
    """An `async def` handler that awaits 0.1 s: a hundred of them share the worker's loop."""
    await asyncio.sleep(0.1)


@handler("bench.durable.threaded", queue=QUEUE, max_attempts=1)
def threaded(payload: dict) -> None:
    """The same 0.1 s in a plain handler, which holds its thread for it."""
    time.sleep(0.1)
