"""Django Tasks used by the backend tests; workers load them with ``--import tests.tasks_demo``."""
from __future__ import annotations

import asyncio
import os
import threading
import time

from leases.tasks import Needs, handler
from leases.tasks.backend import Task  # noqa: F401 - the framework in use (django.tasks or the backport)
from leases.tasks.context import current

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task(priority=10)
def urgent(tag: str) -> str:
    return tag


@task()
def explode(n: int) -> None:
    raise ValueError(f"exploded {n}")


@task(takes_context=True)
def which_attempt(context, fail_until: int) -> int:
    if context.attempt < fail_until:
        raise RuntimeError(f"attempt {context.attempt}")
    return context.attempt


@task()
async def async_add(a: int, b: int) -> int:
    return a + b


@task()
def durable_nap(seconds: float) -> str:
    """A task that sleeps durably, through its attempt's context, then ends."""
    current().sleep(seconds)
    return "rested"


@task()
async def async_where(seconds: float) -> dict:
    """Where an async task runs: the worker's event loop thread, its context reachable."""
    began = time.time()
    await asyncio.sleep(seconds)
    return {"thread": threading.current_thread().name, "job": current().job_id, "began": began, "ended": time.time()}


@handler(limit_key="one", concurrency=1)
@task()
def one_at_a_time(log: str, seconds: float) -> None:
    """One at a time across every worker: its key, "one", is set above the task."""
    began = time.monotonic()
    time.sleep(seconds)
    with open(log, "a") as out:
        out.write(f"one {began:.6f} {time.monotonic():.6f} {os.getpid()}\n")


@handler(limit_key=lambda site, n: site, rate="2/s")
@task()
def rated_per_site(site: str, n: int) -> int:
    """Two starts a second per site: its key is a function of the task's arguments."""
    return n


@handler(lease=Needs("proxies", target=lambda site: site))
@task()
def leased_call(site: str) -> str:
    """Holds a resource of pool "proxies" while it runs; returns its name (its lease is
    reached through the attempt's context, as a task takes no `ctx`)."""
    return current().lease.name
