"""Durable pipeline tasks and run-level events, driven by in-process burst workers: a
task may step, sleep and wait for an event like any durable handler (its run waits with
it); a stage with `wait_for` starts only once the run received that event, sent before or
after the stage could start; events to ended runs and bad events are one line; `run.wait`
returns the ended run; cancelling a run asks its running tasks to stop.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connections

from leases.clock import db_now
from leases.pipelines import Pipeline, Stage
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks import handler, send_event
from leases.tasks.models import Job, JobError, JobStep
from leases.tasks.worker import JobWorker
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

CALLS: Counter = Counter()
STARTED = threading.Event()
SAW: list = []


def counted(name: str, value):
    CALLS[name] += 1
    return value


@handler("pe.durable", backoff=0.0)
def durable_task(payload, ctx):
    got = ctx.step("fetch", counted, "fetch", payload["context"]["n"])
    ctx.sleep(600)
    return [got, ctx.wait_for("go")]


@handler("pe.prep", backoff=0.0)
def prep(payload):
    return counted("prep", "prepared")


@handler("pe.ship", backoff=0.0)
def ship(payload):
    return counted("ship", payload["results"]["pe.prep"] + " and shipped")


@handler("pe.watch", backoff=0.0)
def watch(payload, ctx):
    STARTED.set()
    deadline = time.monotonic() + 60
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    SAW.append(ctx.cancelled)
    ctx.step("after", counted, "after", 1)  # raises Cancelled
    return "ran on"


durable = Pipeline("pe-durable", [Stage("work", ["pe.durable"]), Stage("then", ["pe.prep"])])
approval = Pipeline("pe-approval", [Stage("prep", ["pe.prep"]), Stage("ship", ["pe.ship"], wait_for="approved")])
watched = Pipeline("pe-watched", [Stage("watch", ["pe.watch"])])


@pytest.fixture(autouse=True)
def fresh():
    CALLS.clear()
    SAW.clear()
    STARTED.clear()
    yield


def drain() -> JobWorker:
    worker = JobWorker(queues=["default"], concurrency=2, ttl=5, burst=True, poll=0.01)
    worker.run()
    return worker


def stage_status(run: Run) -> dict[str, str]:
    return dict(run.stages.values_list("name", "status"))


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, text
    return text


# -- durable tasks ---------------------------------------------------------------------------


def test_a_task_steps_sleeps_and_waits_like_a_durable_handler_and_its_run_waits_with_it():
    run = durable.start(context={"n": 3})
    drain()
    (job,) = Job.objects.filter(name="pe.durable")
    assert (job.status, job.waiting_for) == (Job.READY, "sleep")
    assert TaskRun.objects.get(run=run, task="pe.durable").status == TaskRun.QUEUED
    past = db_now() - timedelta(seconds=1)  # the sleep's end has come
    JobStep.objects.filter(job_id=job.pk, done=False).update(until=past)
    Job.objects.filter(pk=job.pk).update(run_at=past)
    drain()
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.READY, "event:go")
    run.refresh_from_db()
    assert run.status == Run.RUNNING and stage_status(run) == {"work": "running", "then": "waiting"}
    send_event(job.pk, "go", {"ok": True})
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    assert TaskRun.objects.get(run=run, task="pe.durable").result == [3, {"ok": True}]
    assert CALLS == Counter(fetch=1, prep=1)  # three runs of the task's handler, one fetch
    assert list(JobStep.objects.filter(job_id=job.pk).order_by("seq").values_list("name", flat=True)) == [
        "fetch", "sleep", "wait:go"]


# -- stages that wait for a run's event ------------------------------------------------------


def test_a_stage_waiting_for_an_event_starts_only_once_it_arrives():
    run = approval.start()
    drain()
    run.refresh_from_db()
    assert run.status == Run.RUNNING
    assert stage_status(run) == {"prep": "succeeded", "ship": "waiting"}
    assert not TaskRun.objects.filter(run=run, task="pe.ship").exists() and CALLS == Counter(prep=1)
    assert run.send_event("approved", {"by": "ann"}) is True
    assert stage_status(run)["ship"] == "running"  # started by the send, in its transaction
    assert run.send_event("approved", {"by": "bob"}) is False  # had it: the first data stays
    assert run.events == {"approved": {"by": "ann"}}
    drain()
    finished = run.wait(30)
    assert finished is run and run.status == Run.SUCCEEDED
    assert TaskRun.objects.get(run=run, task="pe.ship").result == "prepared and shipped"


def test_an_event_sent_before_its_stage_could_start_is_kept():
    run = approval.start()
    assert run.send_event("approved") is True  # prep has not run yet
    assert stage_status(run) == {"prep": "running", "ship": "waiting"}
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and CALLS == Counter(prep=1, ship=1)


def test_send_event_to_an_ended_run_or_with_bad_input_is_one_line_and_changes_nothing():
    run = approval.start()
    with pytest.raises(ValueError) as raised:
        run.send_event("approved", {"at": object()})
    assert "the event's data" in one_line(raised)
    with pytest.raises(ValueError) as raised:
        run.send_event("", 1)
    assert "event name" in one_line(raised)
    run.refresh_from_db()
    assert run.events == {}
    assert run.cancel() is True
    with pytest.raises(ValueError) as raised:
        run.send_event("approved")
    assert one_line(raised) == f"pipeline run #{run.pk} has cancelled: the event 'approved' was not sent"
    run.refresh_from_db()
    assert run.events == {} and stage_status(run)["ship"] == "cancelled"


# -- waiting on a run ------------------------------------------------------------------------


def test_run_wait_returns_the_run_once_it_ended_and_times_out_while_it_is_live():
    run = approval.start()
    with pytest.raises(TimeoutError) as raised:
        run.wait(0.2)
    assert one_line(raised) == f"pipeline run #{run.pk} is still running after 0.2s"
    out: dict = {}

    def waiter() -> None:
        try:
            out["run"] = Run.objects.get(pk=run.pk).wait(60)
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    drain()
    run.send_event("approved")
    drain()
    thread.join(60)
    assert not thread.is_alive()
    assert (out["run"].pk, out["run"].status, out["run"].finished_at is not None) == (run.pk, Run.SUCCEEDED, True)
    with pytest.raises(ValueError):
        run.wait(-1)


# -- cancelling a run ------------------------------------------------------------------------


def test_cancelling_a_run_asks_its_running_tasks_to_stop():
    run = watched.start()
    worker = JobWorker(queues=["default"], concurrency=1, ttl=1, poll=0.01)  # heartbeat every 1/3 s

    def serve() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()  # the thread's own

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert STARTED.wait(30)
        (job,) = Job.objects.filter(name="pe.watch")
        assert job.status == Job.RUNNING and job.cancel_requested_at is None
        assert run.cancel() is True and run.status == Run.CANCELLED
        assert Job.objects.get(pk=job.pk).cancel_requested_at is not None  # asked, in the cancel's transaction
        wait_for(lambda: Job.objects.get(pk=job.pk).status == Job.CANCELLED, timeout=30, what="the task to stop")
        wait_for(lambda: TaskRun.objects.get(run=run).status != TaskRun.QUEUED, timeout=30, what="its record")
    finally:
        worker.stop()
        thread.join(30)
    assert SAW == [True] and not CALLS  # it saw the cancel; the step after it never ran
    assert JobError.objects.get(job_id=job.pk).exception == "leases.exceptions.Cancelled"
    assert TaskRun.objects.get(run=run).status == TaskRun.CANCELLED
    assert StageRun.objects.get(run=run).status == StageRun.CANCELLED
