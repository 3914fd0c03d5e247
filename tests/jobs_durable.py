"""Durable handlers for the worker process tests; workers load them with
``--import tests.jobs_durable``.

Each handler appends lines to files named in its payload, so a test counts across
processes what ran where without trusting the database it checks: an "entry" line per
entry into the handler, a "begin" and an "end" line per run of a step's body (an end
carries the body's unique result, to tell which run's result was stored). The
environment shapes an attempt: ``JOBS_DURABLE_SLOW`` overrides the seconds of the slow
step, so the worker a test kills is inside it while the one that takes over is quick.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid

from leases.exceptions import Cancelled
from leases.tasks import handler


def _line(path: str | None, *parts: object) -> None:
    """Append one line; a single small write, so lines of several threads never mix."""
    if path:
        with open(path, "a") as out:
            out.write(" ".join(str(part) for part in parts) + "\n")


def _body(log: str, n: int, index: int, seconds: float) -> dict:
    """A step's body: logs its begin and end, returns something no other run returns."""
    _line(log, "begin", n, index, os.getpid())
    time.sleep(seconds)
    token = uuid.uuid4().hex
    _line(log, "end", n, index, os.getpid(), token)
    return {"token": token, "index": index}


#: The steps of `stepper`, in order: a repeated name takes the next place (its counter).
STEPS = ("fetch", "parse", "slow", "parse", "store")
#: Where the slow step is: two completed steps lie before it.
SLOW = STEPS.index("slow")


@handler("durable-steps", queue="default", max_attempts=3, backoff=0.0)
def stepper(payload, ctx):
    """Runs STEPS; the slow one sleeps `slow` seconds (JOBS_DURABLE_SLOW in the worker's
    environment overrides it). Returns the results the steps returned or stored."""
    _line(payload["entries"], "entry", payload["n"], os.getpid(), ctx.attempt)
    slow = float(os.environ.get("JOBS_DURABLE_SLOW", payload.get("slow", 0.1)))
    return [ctx.step(name, _body, payload["log"], payload["n"], index, slow if index == SLOW else 0.0)
            for index, name in enumerate(STEPS)]


def _tick(n: int) -> int:
    time.sleep(0.05)
    return n


@handler("durable-cooperative", queue="default", max_attempts=1)
def cooperative(payload, ctx):
    """Works until cancelled: by steps ("step": each one checks), or by a loop that checks
    `ctx.cancelled` ("check") and raises `Cancelled` itself."""
    _line(payload["entries"], "entry", payload["n"], os.getpid(), time.time())
    deadline = time.monotonic() + payload.get("seconds", 60)
    while time.monotonic() < deadline:
        if payload.get("mode") == "step":
            ctx.step("tick", _tick, payload["n"])
        else:
            if ctx.cancelled:
                raise Cancelled("saw ctx.cancelled and stopped")
            time.sleep(0.05)
    return "never cancelled"


@handler("durable-stubborn", queue="default", max_attempts=1)
def stubborn(payload, ctx):
    """Ignores its context: sleeps through any cancel, and logs when it finally returns."""
    _line(payload["entries"], "entry", payload["n"], os.getpid(), time.time())
    time.sleep(payload.get("seconds", 60))
    _line(payload["entries"], "exit", payload["n"], os.getpid(), time.time())
    return "slept through"


@handler("durable-async", queue="default", max_attempts=3, backoff=0.0)
async def napper(payload):
    """Awaits `seconds` on the worker's event loop; logs "start|end n time pid"."""
    _line(payload.get("log"), "start", payload["n"], f"{time.time():.6f}", os.getpid())
    await asyncio.sleep(payload.get("seconds", 0.1))
    _line(payload.get("log"), "end", payload["n"], f"{time.time():.6f}", os.getpid())
    return payload["n"]


@handler("durable-sleeper", queue="default", max_attempts=3, backoff=0.0)
def sleeper(payload, ctx):
    """Sleeps durably for `seconds` after a step; logs each entry."""
    _line(payload["entries"], "entry", payload["n"], os.getpid())
    ctx.step("before", _tick, payload["n"])
    ctx.sleep(payload.get("seconds", 3600))
    return "woke"
