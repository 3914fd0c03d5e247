"""`async def` handlers, run by in-process burst workers: they run on the worker's event
loop and their results are stored; the context's awaitable forms (astep, asleep,
asleep_until, await_for, apatched) keep their promises as the plain forms do (a step runs
once, a sleep or a wait gives the slot back and resumes, a declared change keeps stored
runs on the old path); a step function that is a coroutine function is awaited; handlers
that await overlap within the worker's concurrency. An async generator handler is refused
(test_queue_poison)."""
from __future__ import annotations

import asyncio
import threading
from collections import Counter
from datetime import datetime, timedelta

import pytest

from leases.clock import db_now
from leases.tasks import handler, push, send_event
from leases.tasks.models import Job, JobError, JobStep
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

QUEUE = "durable-async"
CALLS: Counter = Counter()
VERSION = {"n": 1}
#: Async handlers running at this moment, and the most at once (one loop thread: no lock).
OVERLAP = {"now": 0, "most": 0}
THREADS: set[str] = set()


def counted(name: str, value):
    """A plain step function (run on a thread of the loop's executor)."""
    CALLS[name] += 1
    return {"value": value}


async def fetched(n: int):
    """A coroutine step function: awaited on the loop."""
    CALLS["fetch"] += 1
    await asyncio.sleep(0)
    THREADS.add(threading.current_thread().name)
    return n * 10


@handler("da.steps", queue=QUEUE, max_attempts=2, backoff=0.0)
async def steps(payload, ctx):
    THREADS.add(threading.current_thread().name)
    asyncio.get_running_loop()  # raises outside a loop
    a = await ctx.astep("fetch", fetched, payload["n"])
    b = await ctx.astep("parse", counted, "parse", a)
    if ctx.attempt == 1:
        raise RuntimeError("fails after its steps, on the first attempt")
    return [a, b]


@handler("da.sleeper", queue=QUEUE, max_attempts=1)
async def sleeper(payload, ctx):
    before = await ctx.astep("before", counted, "before", 1)
    if "until" in payload:
        await ctx.asleep_until(datetime.fromisoformat(payload["until"]))
    else:
        await ctx.asleep(payload["seconds"])
    return [before, await ctx.astep("after", counted, "after", 2)]


@handler("da.waiter", queue=QUEUE, max_attempts=1)
async def waiter(payload, ctx):
    await ctx.astep("asked", counted, "asked", 0)
    default = {"default": payload["default"]} if "default" in payload else {}
    return await ctx.await_for("go", timeout=payload.get("timeout"), **default)


@handler("da.versioned", queue=QUEUE, max_attempts=1)
async def versioned(payload, ctx):
    if VERSION["n"] == 1:
        got = ["v1", await ctx.astep("fetch", counted, "fetch", payload["n"])]
    elif await ctx.apatched("parse-v2"):
        got = ["new", await ctx.astep("parse", counted, "parse", payload["n"])]
    else:
        got = ["old", await ctx.astep("fetch", counted, "fetch", payload["n"])]
    await ctx.asleep(600)
    return got


@handler("da.nap", queue=QUEUE)
async def nap(payload):
    OVERLAP["now"] += 1
    OVERLAP["most"] = max(OVERLAP["most"], OVERLAP["now"])
    try:
        await asyncio.sleep(0.3)
    finally:
        OVERLAP["now"] -= 1
    return payload["n"] * 2


@pytest.fixture(autouse=True)
def fresh():
    CALLS.clear()
    THREADS.clear()
    VERSION["n"] = 1
    OVERLAP.update(now=0, most=0)
    yield
    VERSION["n"] = 1


def drain(concurrency: int = 2) -> JobWorker:
    worker = JobWorker(queues=[QUEUE], concurrency=concurrency, ttl=5, burst=True, poll=0.01)
    worker.run()
    return worker


def fast_forward(job: Job) -> None:
    """The end of the job's pending sleep or wait has come (as if its time had passed)."""
    past = db_now() - timedelta(seconds=1)
    JobStep.objects.filter(job_id=job.pk, done=False).update(until=past)
    Job.objects.filter(pk=job.pk).update(run_at=past)


def names(job: Job) -> list[str]:
    return list(JobStep.objects.filter(job_id=job.pk).order_by("seq").values_list("name", flat=True))


def test_an_async_handler_runs_on_the_loop_and_its_steps_run_once():
    job = push("da.steps", {"n": 4})
    stats = drain().stats
    job.refresh_from_db()
    assert (job.status, job.attempt, job.result) == (Job.SUCCEEDED, 2, [40, {"value": 40}])
    assert stats.retried == 1 and CALLS == Counter(fetch=1, parse=1)  # two attempts, each step once
    assert THREADS == {"leases-loop"}  # the handler and its coroutine step: on the worker's loop
    assert names(job) == ["fetch", "parse"]


def test_asleep_gives_the_slot_back_and_resumes_without_rerunning_steps():
    job = push("da.sleeper", {"seconds": 600})
    stats = drain().stats
    job.refresh_from_db()
    assert (job.status, job.waiting_for, job.attempt) == (Job.READY, "sleep", 0)
    assert job.run_at > db_now() + timedelta(seconds=500)
    assert (stats.suspended, stats.succeeded) == (1, 0)
    fast_forward(job)
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, [{"value": 1}, {"value": 2}])
    assert CALLS == Counter(before=1, after=1)


def test_asleep_until_suspends_to_that_moment():
    until = db_now() + timedelta(minutes=5)
    job = push("da.sleeper", {"until": until.isoformat()})
    drain()
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.READY, "sleep")
    assert abs((job.run_at - until).total_seconds()) < 0.001


def test_a_bad_asleep_fails_the_attempt_in_one_line_and_stores_no_sleep():
    job = push("da.sleeper", {"seconds": -5})
    drain()
    job.refresh_from_db()
    assert job.status == Job.DEAD
    (error,) = JobError.objects.filter(job_id=job.pk)
    assert error.exception == "builtins.ValueError"
    assert "sleep seconds must be a finite number" in error.message and "\n" not in error.message
    assert names(job) == ["before"]


def test_await_for_suspends_until_the_event_and_returns_its_data():
    job = push("da.waiter", {})
    assert drain().stats.suspended == 1
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.READY, "event:go")
    send_event(job.pk, "go", {"ok": True})
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, {"ok": True})
    assert CALLS["asked"] == 1 and names(job) == ["asked", "wait:go"]


def test_await_for_past_its_timeout_gives_the_default_or_raises_timed_out():
    kind = push("da.waiter", {"timeout": 600, "default": "nobody"})
    bare = push("da.waiter", {"timeout": 600})
    drain()
    for job in (kind, bare):
        fast_forward(job)
    drain()
    kind.refresh_from_db()
    bare.refresh_from_db()
    assert (kind.status, kind.result) == (Job.SUCCEEDED, "nobody")
    assert bare.status == Job.DEAD
    assert JobError.objects.get(job_id=bare.pk).exception == "leases.exceptions.TimedOut"


def test_apatched_takes_new_jobs_the_new_way_and_leaves_stored_runs_on_the_old():
    old = push("da.versioned", {"n": 1})
    drain()
    VERSION["n"] = 2
    new = push("da.versioned", {"n": 2})
    drain()
    assert names(old) == ["fetch", "sleep"]
    assert names(new) == ["patch:parse-v2", "parse", "sleep"]
    fast_forward(old)
    fast_forward(new)
    drain()
    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.status, old.result) == (Job.SUCCEEDED, ["old", {"value": 1}])
    assert (new.status, new.result) == (Job.SUCCEEDED, ["new", {"value": 2}])
    assert CALLS == Counter(fetch=1, parse=1)


def test_async_handlers_that_await_overlap_within_the_concurrency():
    jobs = [push("da.nap", {"n": n}) for n in range(8)]
    drain(concurrency=4)
    assert 1 < OVERLAP["most"] <= 4
    results = dict(Job.objects.filter(pk__in=[job.pk for job in jobs]).values_list("pk", "result"))
    assert results == {job.pk: n * 2 for n, job in enumerate(jobs)}
    assert not Job.objects.exclude(status=Job.SUCCEEDED).exists()
