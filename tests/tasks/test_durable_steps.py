"""Durable handlers' steps and sleeps, run by in-process burst workers: a step's function
runs once for its job, whatever reruns the handler (a retry after a later failure, the
end of a sleep), repeated names keep places of their own, what cannot be stored fails
its step and stores nothing, a stale attempt cannot write, a changed handler meets its
stored steps in one line unless it declares the change (`ctx.patched`), and a sleep gives
the worker's slot back and resumes after its end. Events and cancels: test_durable_events.
"""
from __future__ import annotations

import math
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from leases.clock import db_now
from leases.tasks import handler, push
from leases.tasks.context import context_for
from leases.tasks.jobs.steps import Superseded
from leases.tasks.models import Job, JobError, JobStep
from leases.tasks.models.durable import STEP_NAME_LENGTH
from leases.tasks.worker import JobWorker
from leases.validation import MAX_SECONDS
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

QUEUE = "durable-steps"
CALLS: Counter = Counter()
#: Which code the "ds.versioned" handler runs: 1 and 2 differ without saying so, 3 declares it.
VERSION = {"n": 1}


def counted(name: str, value):
    """A step's function: counts its calls, so a test sees whether it ran again."""
    CALLS[name] += 1
    return {"value": value}


@handler("ds.retried", queue=QUEUE, max_attempts=2, backoff=0.0)
def retried(payload, ctx):
    got = ctx.step("fetch", counted, "fetch", payload["n"])
    if ctx.attempt == 1:
        raise RuntimeError("fails after its step, on the first attempt")
    return got


@handler("ds.pages", queue=QUEUE, max_attempts=2, backoff=0.0)
def pages(payload, ctx):
    got = [ctx.step("page", counted, "page", n)["value"] for n in range(3)]
    if ctx.attempt == 1:
        raise RuntimeError("fails after its steps, on the first attempt")
    return got


@handler("ds.sleeper", queue=QUEUE, backoff=0.0)
def sleeper(payload, ctx):
    before = ctx.step("before", counted, "before", 1)
    if "until" in payload:
        ctx.sleep_until(datetime.fromisoformat(payload["until"]))
    else:
        ctx.sleep(payload["seconds"])
    return [before, ctx.step("after", counted, "after", 2)]


@handler("ds.unstorable", queue=QUEUE, max_attempts=1)
def unstorable(payload, ctx):
    ctx.step("fine", counted, "fine", 1)
    return ctx.step("odd", lambda: {"when": datetime.now(timezone.utc)})


@handler("ds.versioned", queue=QUEUE, max_attempts=3, backoff=0.0)
def versioned(payload, ctx):
    if VERSION["n"] == 1:
        got = ["v1", ctx.step("fetch", counted, "fetch", payload["n"])]
    elif VERSION["n"] == 2:  # renamed its first step without saying so
        got = ["v2", ctx.step("parse", counted, "parse", payload["n"])]
    elif ctx.patched("parse-v2"):  # ... or saying so: new runs take the new path
        got = ["new", ctx.step("parse", counted, "parse", payload["n"])]
    else:
        got = ["old", ctx.step("fetch", counted, "fetch", payload["n"])]
    ctx.sleep(600)
    return got


@handler("ds.plain", queue=QUEUE)
def plain(payload, ctx):
    return None


@pytest.fixture(autouse=True)
def fresh():
    CALLS.clear()
    VERSION["n"] = 1
    yield
    CALLS.clear()
    VERSION["n"] = 1


def drain(max_jobs: int | None = None) -> JobWorker:
    """A burst worker's run; with `max_jobs` it leaves once it claimed that many and none
    runs, not lingering for a poll (the jobs a test suspends for a second must not come
    due before it left)."""
    worker = JobWorker(queues=[QUEUE], concurrency=2, ttl=5, burst=True, poll=0.01, max_jobs=max_jobs)
    worker.run()
    return worker


def claimed_context(worker_name: str = ""):
    """A running attempt of a fresh job and its context, claimed by a worker of our own."""
    job = push("ds.plain", {"at": worker_name or "one"})
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (claimed,) = worker.claim(1)
    assert claimed.id == job.pk
    return worker, claimed, context_for(claimed, "default")


def fast_forward(job: Job) -> None:
    """The end of the job's pending sleep has come (as if its time had passed)."""
    past = db_now() - timedelta(seconds=1)
    JobStep.objects.filter(job_id=job.pk, done=False).update(until=past)
    Job.objects.filter(pk=job.pk).update(run_at=past)


def steps_of(job: Job) -> list[tuple]:
    return list(JobStep.objects.filter(job_id=job.pk).order_by("seq").values_list("seq", "name", "done"))


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, text
    return text


# -- steps run once ----------------------------------------------------------------------


def test_a_retry_returns_the_stored_step_without_running_it_again():
    job = push("ds.retried", {"n": 7})
    stats = drain().stats
    job.refresh_from_db()
    assert (job.status, job.attempt, job.result) == (Job.SUCCEEDED, 2, {"value": 7})
    assert stats.retried == 1 and CALLS["fetch"] == 1  # two attempts, one call
    assert steps_of(job) == [(1, "fetch", True)]
    assert JobStep.objects.get(job_id=job.pk).result == {"value": 7}


def test_repeated_names_keep_places_of_their_own():
    job = push("ds.pages", {})
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, [0, 1, 2])  # each place its own result
    assert CALLS["page"] == 3  # not six: the retry ran none again
    assert steps_of(job) == [(1, "page", True), (2, "page", True), (3, "page", True)]


def test_a_result_that_is_not_json_fails_its_step_in_one_line_and_stores_nothing():
    job = push("ds.unstorable", {})
    drain()
    job.refresh_from_db()
    assert job.status in (Job.FAILED, Job.DEAD)
    (error,) = JobError.objects.filter(job_id=job.pk)
    assert "the result of step 'odd'" in error.message and "\n" not in error.message
    assert steps_of(job) == [(1, "fine", True)]  # the step before it stays; nothing of it


@pytest.mark.parametrize("name", ["", "   ", None, 7, " padded", "x" * (STEP_NAME_LENGTH + 1), "line\nbreak"])
def test_a_bad_step_name_is_one_line_at_the_call_and_runs_nothing(name):
    _, _, ctx = claimed_context()
    with pytest.raises(ValueError) as raised:
        ctx.step(name, counted, "bad", 1)
    assert "step name" in one_line(raised)
    assert not CALLS and not JobStep.objects.exists()
    assert ctx.step("good", counted, "good", 1) == {"value": 1}  # the bad call took no place
    assert JobStep.objects.get().seq == 1


def test_a_patch_name_too_long_for_its_marker_is_one_line():
    _, _, ctx = claimed_context()
    with pytest.raises(ValueError) as raised:
        ctx.patched("p" * (STEP_NAME_LENGTH - len("patch:") + 1))
    assert "patch name" in one_line(raised)
    assert ctx.patched("p" * (STEP_NAME_LENGTH - len("patch:"))) is True
    assert len(JobStep.objects.get().name) == STEP_NAME_LENGTH


def test_a_stale_attempt_cannot_write_a_step():
    """Its claim was taken back (handed back, claimed again elsewhere): its late writes are
    fenced out, and the current attempt's are not."""
    first, claimed, stale = claimed_context()
    assert first.hand_back() == 1
    second = JobWorker(queues=[QUEUE], ttl=30)
    second.register()
    (again,) = second.claim(1)
    assert again.id == claimed.id and again.claims == claimed.claims + 1
    with pytest.raises(Superseded):
        stale.step("write", counted, "write", "stale")
    with pytest.raises(Superseded):
        stale.sleep(60)
    assert not JobStep.objects.exists()
    current = context_for(again, "default")
    assert current.step("write", counted, "write", "current") == {"value": "current"}
    assert JobStep.objects.get().result == {"value": "current"}
    row = Job.objects.get(pk=claimed.id)
    assert (row.status, row.worker, row.waiting_for) == (Job.RUNNING, second.name, "")


# -- versioning ------------------------------------------------------------------------------


def test_a_changed_handler_meeting_a_stored_step_of_another_name_fails_in_one_line():
    job = push("ds.versioned", {"n": 1})
    drain()  # v1: "fetch" stored, then asleep
    assert steps_of(job) == [(1, "fetch", True), (2, "sleep", False)]
    VERSION["n"] = 2
    fast_forward(job)
    drain()
    job.refresh_from_db()
    assert job.status == Job.FAILED and job.attempt == 1  # StepMismatch is not retried
    (error,) = JobError.objects.filter(job_id=job.pk)
    assert error.exception == "leases.exceptions.StepMismatch"
    assert error.message.startswith("step 1 was 'fetch', now 'parse'") and "\n" not in error.message
    assert CALLS == Counter(fetch=1)  # the new step never ran


def test_patched_takes_new_jobs_the_new_way_and_leaves_stored_runs_on_the_old():
    old = push("ds.versioned", {"n": 1})
    drain()  # deployed before the change: asleep with its "fetch" stored
    VERSION["n"] = 3
    new = push("ds.versioned", {"n": 2})
    drain()  # the new code meets the new job first: the marker, then "parse"
    assert steps_of(new) == [(1, "patch:parse-v2", True), (2, "parse", True), (3, "sleep", False)]
    assert steps_of(old) == [(1, "fetch", True), (2, "sleep", False)]
    fast_forward(old)
    fast_forward(new)
    drain()
    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.status, old.result) == (Job.SUCCEEDED, ["old", {"value": 1}])
    assert (new.status, new.result) == (Job.SUCCEEDED, ["new", {"value": 2}])
    assert CALLS == Counter(fetch=1, parse=1)  # each ran once, by its own job
    assert [name for _, name, _ in steps_of(old)] == ["fetch", "sleep"]  # no marker slipped in


# -- durable sleep ---------------------------------------------------------------------------


def test_a_sleep_gives_the_slot_back_and_resumes_after_its_end_without_rerunning_steps():
    job = push("ds.sleeper", {"seconds": 1})
    stats = drain(max_jobs=1).stats  # returns with nothing running: no thread waits out the sleep
    job.refresh_from_db()
    now = db_now()
    assert (job.status, job.waiting_for, job.attempt, job.worker) == (Job.READY, "sleep", 0, "")
    assert (stats.claimed, stats.suspended, stats.succeeded) == (1, 1, 0)
    begun = JobStep.objects.get(job_id=job.pk, seq=2)
    assert (begun.name, begun.done, begun.until) == ("sleep", False, job.run_at)
    assert begun.until - begun.at == timedelta(seconds=1)  # from its start, by the database clock
    assert Job.describe(job.status, job.attempt, job.expires_at, now, job.waiting_for) == "sleeping"
    wait_for(lambda: db_now() >= job.run_at, timeout=30, what="the sleep's end")
    drain()
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.SUCCEEDED, "")
    assert job.result == [{"value": 1}, {"value": 2}]
    assert CALLS == Counter(before=1, after=1)
    assert [(seq, name) for seq, name, _ in steps_of(job)] == [(1, "before"), (2, "sleep"), (3, "after")]


def test_sleep_until_suspends_to_that_moment_and_then_finishes():
    until = db_now() + timedelta(seconds=1)
    job = push("ds.sleeper", {"until": until.isoformat()})
    drain(max_jobs=1)
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.READY, "sleep")
    assert abs((job.run_at - until).total_seconds()) < 0.001
    wait_for(lambda: db_now() >= until, timeout=30, what="the moment")
    drain()
    job.refresh_from_db()
    assert job.status == Job.SUCCEEDED and CALLS == Counter(before=1, after=1)


@pytest.mark.parametrize("seconds", [-1, -1e-9, math.nan, math.inf, -math.inf, MAX_SECONDS + 1, True, "5", None])
def test_a_bad_sleep_is_one_line_and_stores_nothing(seconds):
    _, claimed, ctx = claimed_context()
    with pytest.raises(ValueError) as raised:
        ctx.sleep(seconds)
    assert "sleep seconds" in one_line(raised)
    assert not JobStep.objects.exists()
    assert Job.objects.get(pk=claimed.id).status == Job.RUNNING


@pytest.mark.parametrize("when", [
    datetime(2030, 1, 1),  # naive
    datetime.now(timezone.utc) + timedelta(seconds=MAX_SECONDS + 86400),
    "2030-01-01T00:00:00+00:00",
    1_900_000_000,
])
def test_a_bad_sleep_until_is_one_line_and_stores_nothing(when):
    _, claimed, ctx = claimed_context()
    with pytest.raises(ValueError) as raised:
        ctx.sleep_until(when)
    assert "sleep_until" in one_line(raised)
    assert not JobStep.objects.exists()
    assert Job.objects.get(pk=claimed.id).status == Job.RUNNING
