"""Durable handlers that wait for events, and running jobs cancelled, in one process: a
wait suspends its job in the database until `send_event` (by id, Job or key) wakes it and
hands it the data; an event sent before the wait is kept (no lost wake-up) and each wait
takes exactly one, in order; a timeout raises TimedOut or gives the default; bad sends
(no such job, an ended one, bad names or data) are one line and write nothing. A cancel
asked of a running job reaches its handler at its next step once the worker's heartbeat
read it, or abandons a handler that ignores it after the grace; the job ends cancelled.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leases.clock import db_now
from leases.exceptions import Cancelled
from leases.tasks import handler, push, send_event
from leases.tasks.context import context_for
from leases.tasks.jobs.actions import cancel
from leases.tasks.jobs.steps import EVENT_NAME_LENGTH
from leases.tasks.models import Job, JobError, JobEvent, JobStep
from leases.tasks.worker import JobWorker, execute
from leases.validation import MAX_SECONDS
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

QUEUE = "durable-events"
CALLS: Counter = Counter()
STARTED = threading.Event()
RELEASE = threading.Event()
SAW: list = []

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def counted(name: str):
    CALLS[name] += 1
    return name


@handler("de.approval", queue=QUEUE, max_attempts=1)
def approval(payload, ctx):
    ctx.step("asked", counted, "asked")
    default = {"default": payload["default"]} if "default" in payload else {}
    return ctx.wait_for(payload.get("event", "approved"), timeout=payload.get("timeout"), **default)


@handler("de.twice", queue=QUEUE, max_attempts=1)
def twice(payload, ctx):
    return [ctx.wait_for("item"), ctx.wait_for("item")]


@handler("de.cooperative", queue=QUEUE, backoff=0.0)
def cooperative(payload, ctx):
    ctx.step("started", counted, "started")
    STARTED.set()
    deadline = time.monotonic() + 60
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    SAW.append(ctx.cancelled)
    ctx.step("after", counted, "after")  # raises Cancelled once the worker learned it
    return "ran on"


@handler("de.stubborn", queue=QUEUE, backoff=0.0)
def stubborn(payload, ctx):
    STARTED.set()
    RELEASE.wait(60)  # never looks at ctx
    return "ignored the cancel"


@pytest.fixture(autouse=True)
def fresh():
    CALLS.clear()
    SAW.clear()
    STARTED.clear()
    RELEASE.clear()
    yield
    RELEASE.set()  # a stubborn handler's thread ends


def drain(max_jobs: int | None = None) -> JobWorker:
    """A burst worker's run; with `max_jobs` it leaves once it claimed that many and none
    runs, not lingering for a poll (a wait's short timeout must not end before it left)."""
    worker = JobWorker(queues=[QUEUE], concurrency=2, ttl=5, burst=True, poll=0.01, max_jobs=max_jobs)
    worker.run()
    return worker


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert text and "\n" not in text, text
    return text


def nothing_sent() -> bool:
    return not JobEvent.objects.exists()


# -- waits and events ------------------------------------------------------------------------


@pytest.mark.parametrize("by", ["id", "job", "key"])
def test_a_wait_suspends_its_job_until_the_event_wakes_it_with_the_data(by):
    job = push("de.approval", {}, key="order-7")
    assert drain().stats.suspended == 1
    job.refresh_from_db()
    now = db_now()
    assert (job.status, job.waiting_for, job.attempt) == (Job.READY, "event:approved", 0)
    assert job.run_at > now + timedelta(days=365)  # no timeout: a long way off
    assert Job.describe(job.status, job.attempt, job.expires_at, now, job.waiting_for) == "waiting for 'approved'"
    target = {"id": job.pk, "job": job, "key": "order-7"}[by]
    assert send_event(target, "approved", {"by": "ann"}) == job.pk
    assert Job.objects.get(pk=job.pk).run_at <= db_now()  # woken: due now
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, {"by": "ann"})
    assert CALLS["asked"] == 1  # the step before the wait ran once
    assert list(JobEvent.objects.values_list("name", "taken_seq")) == [("approved", 2)]


def test_an_event_sent_before_the_wait_is_kept_and_taken_at_once():
    job = push("de.approval", {})
    send_event(job.pk, "approved", [1, 2])  # the handler has not even started
    stats = drain().stats
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, [1, 2])
    assert (stats.claimed, stats.suspended) == (1, 0)  # never suspended: no lost wake-up


def test_an_event_sent_while_the_job_runs_is_seen_by_its_next_wait():
    job = push("de.approval", {})
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (claimed,) = worker.claim(1)
    ctx = context_for(claimed, "default")
    ctx.step("asked", counted, "asked")
    send_event(job.pk, "approved", "late")  # between the step and the wait
    assert ctx.wait_for("approved") == "late"
    assert JobEvent.objects.get().taken_seq == 2


def test_each_wait_takes_exactly_one_event_in_order():
    job = push("de.twice", {})
    for n in (1, 2, 3):
        send_event(job.pk, "item", n)
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, [1, 2])
    taken = list(JobEvent.objects.order_by("id").values_list("data", "taken_seq"))
    assert taken == [(1, 1), (2, 2), (3, None)]  # the third waits for a wait that never came


def test_a_second_wait_suspends_until_its_own_event_comes():
    job = push("de.twice", {})
    send_event(job.pk, "item", "a")
    drain()  # the first wait takes "a" at once, the second suspends; the rerun meets the first again
    job.refresh_from_db()
    assert (job.status, job.waiting_for) == (Job.READY, "event:item")
    send_event(job, "item", "b")
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, ["a", "b"])
    assert list(JobStep.objects.order_by("seq").values_list("name", "done")) == [("wait:item", True)] * 2


def test_a_wait_past_its_timeout_raises_timed_out_or_gives_the_default():
    bare = push("de.approval", {"timeout": 1})
    kind = push("de.approval", {"timeout": 1, "default": "nobody"})
    drain(max_jobs=2)
    for job in (bare, kind):
        job.refresh_from_db()
        assert (job.status, job.waiting_for) == (Job.READY, "event:approved")
        begun = JobStep.objects.get(job_id=job.pk, name="wait:approved")
        assert (begun.done, begun.until, begun.until - begun.at) == (False, job.run_at, timedelta(seconds=1))
    wait_for(lambda: db_now() >= max(bare.run_at, kind.run_at), timeout=30, what="the timeouts")
    wait_for(lambda: drain() and not Job.objects.filter(status=Job.READY).exists(), timeout=30, what="the ends")
    bare.refresh_from_db()
    kind.refresh_from_db()
    assert (kind.status, kind.result) == (Job.SUCCEEDED, "nobody")
    assert bare.status == Job.DEAD
    (error,) = JobError.objects.filter(job_id=bare.pk)
    assert (error.exception, error.message) == ("leases.exceptions.TimedOut",
                                                "no event 'approved' came before the wait's timeout")
    with pytest.raises(ValueError) as raised:
        send_event(kind.pk, "approved", 1)
    assert "has ended (succeeded)" in one_line(raised)


def test_the_longest_event_name_send_event_takes_can_be_waited_for():
    """A wait is stored as the step "wait:<event>": send_event takes no name a wait cannot."""
    name = "e" * EVENT_NAME_LENGTH
    job = push("de.approval", {"event": name})
    send_event(job.pk, name, "long")
    with pytest.raises(ValueError) as raised:
        send_event(job.pk, name + "e", "longer")
    assert "event name is longer than" in one_line(raised)
    drain()
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.SUCCEEDED, "long")


# -- bad sends -------------------------------------------------------------------------------


def test_send_event_to_a_missing_job_an_unknown_key_or_an_ended_job_is_one_line_and_writes_nothing():
    with pytest.raises(ValueError) as raised:
        send_event(987654, "approved")
    assert "no job #987654" in one_line(raised)
    with pytest.raises(ValueError) as raised:
        send_event("no-such-key", "approved")
    assert "no unfinished job pushed with key 'no-such-key'" in one_line(raised)
    job = push("de.approval", {}, key="done-key")
    Job.objects.filter(pk=job.pk).update(status=Job.CANCELLED, finished_at=db_now())
    with pytest.raises(ValueError) as raised:
        send_event(job.pk, "approved")
    assert f"job #{job.pk} has ended (cancelled)" in one_line(raised)
    with pytest.raises(ValueError) as raised:
        send_event("done-key", "approved")  # a key names only an unfinished job
    assert "no unfinished job" in one_line(raised)
    with pytest.raises(ValueError) as raised:
        send_event(3.5, "approved")
    one_line(raised)
    assert nothing_sent()


controls = st.sampled_from(["\x00", "\n", "\r", "\x1b", "\x7f", "\ufeff", "\u202e", "\ud800"])
bad_names = st.one_of(
    st.just(""),
    st.text(alphabet=" \t", min_size=1, max_size=3),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=5), controls, st.text(max_size=5)),
    st.builds(lambda s: " " + s, st.text(min_size=1, max_size=5).filter(str.strip)),
    st.text(alphabet="x", min_size=EVENT_NAME_LENGTH + 1, max_size=EVENT_NAME_LENGTH + 50),
    st.integers(),
    st.none(),
    st.binary(min_size=1, max_size=5),
)
bad_timeouts = st.one_of(
    st.floats(max_value=-1e-9, allow_nan=False),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.floats(min_value=MAX_SECONDS * 1.01, max_value=1e300),
    st.booleans(),
    st.text(max_size=3),
)
not_json = st.one_of(
    st.sampled_from([math.nan, math.inf, object(), {1, 2}, b"bytes", "lone \ud800", (lambda: None)]),
    st.builds(lambda v: {"deep": v}, st.sampled_from([object(), math.nan])),
    st.builds(lambda depth: eval("[" * depth + "]" * depth), st.integers(min_value=40, max_value=60)),
)


def a_running_context():
    """The context of a fresh running job (each example gets its own)."""
    push("de.approval", {"n": time.monotonic_ns()})
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (claimed,) = worker.claim(1)
    return context_for(claimed, "default")


@EXAMPLES
@given(name=bad_names)
def test_a_bad_event_name_is_one_line_at_send_and_at_wait_and_writes_nothing(name):
    job = push("de.approval", {"bad": "name"})
    with pytest.raises(ValueError) as raised:
        send_event(job.pk, name, 1)
    assert "event name" in one_line(raised)
    ctx = a_running_context()
    with pytest.raises(ValueError) as raised:
        ctx.wait_for(name)
    one_line(raised)
    assert nothing_sent() and not JobStep.objects.exists()


@EXAMPLES
@given(timeout=bad_timeouts)
def test_a_bad_wait_timeout_is_one_line_and_writes_nothing(timeout):
    ctx = a_running_context()
    with pytest.raises(ValueError) as raised:
        ctx.wait_for("approved", timeout=timeout)
    assert "wait timeout" in one_line(raised)
    assert not JobStep.objects.exists() and ctx._seq == 0  # the wait took no place


@EXAMPLES
@given(data=not_json)
def test_event_data_that_is_not_json_is_one_line_and_writes_nothing(data):
    job = push("de.approval", {"bad": "data"})
    with pytest.raises(ValueError) as raised:
        send_event(job.pk, "approved", data)
    assert "the event's data" in one_line(raised)
    assert nothing_sent() and Job.objects.get(pk=job.pk).run_at == job.run_at


# -- cancelling a running job ----------------------------------------------------------------


def test_the_worker_learns_a_cancel_at_its_heartbeat_and_the_next_step_raises():
    job = push("de.cooperative", {})
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (claimed,) = worker.claim(1)
    worker.running[claimed.id] = claimed
    assert cancel([job.pk], running=True) == 1
    row = Job.objects.get(pk=job.pk)
    assert row.status == Job.RUNNING and row.cancel_requested_at is not None
    assert not claimed.cancel_requested  # asked in the database; the worker has not read it
    worker.heartbeat()
    assert claimed.cancel_requested and claimed.cancel_seen_at is not None
    ctx = context_for(claimed, "default")
    assert ctx.cancelled
    for call in (lambda: ctx.step("x", counted, "x"), lambda: ctx.sleep(1), lambda: ctx.wait_for("approved"),
                 lambda: ctx.patched("v2")):
        with pytest.raises(Cancelled):
            call()
    outcome = execute(claimed)  # the handler's first step raises
    assert outcome.cancelled
    worker.finish([outcome])
    row.refresh_from_db()
    assert (row.status, row.worker) == (Job.CANCELLED, worker.name) and row.finished_at is not None
    (error,) = JobError.objects.filter(job_id=job.pk)
    assert error.exception == "leases.exceptions.Cancelled"
    assert not CALLS and not JobStep.objects.exists()
    assert cancel([job.pk], running=True) == 0  # ended: nothing left to cancel


def run_worker(**options) -> tuple[JobWorker, threading.Thread]:
    worker = JobWorker(queues=[QUEUE], concurrency=1, ttl=1, poll=0.01, **options)  # heartbeat every 1/3 s

    def serve() -> None:
        try:
            worker.run()
        finally:
            connections.close_all()  # the thread's own

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return worker, thread


def test_a_running_handler_sees_the_cancel_at_its_next_step_and_its_job_ends_cancelled():
    job = push("de.cooperative", {})
    worker, thread = run_worker()
    try:
        assert STARTED.wait(30)
        assert cancel([job.pk], running=True) == 1
        wait_for(lambda: Job.objects.get(pk=job.pk).status == Job.CANCELLED, timeout=30, what="the cancel")
    finally:
        worker.stop()
        thread.join(30)
    assert SAW == [True]  # `ctx.cancelled` turned true while it ran
    assert CALLS == Counter(started=1)  # the step after the cancel never ran
    assert list(JobStep.objects.values_list("name", flat=True)) == ["started"]
    assert JobError.objects.get(job_id=job.pk).exception == "leases.exceptions.Cancelled"


def test_a_handler_that_ignores_the_cancel_is_abandoned_after_the_grace():
    job = push("de.stubborn", {})
    worker, thread = run_worker(grace=1.0)
    try:
        assert STARTED.wait(30)
        assert cancel([job.pk], running=True) == 1
        wait_for(lambda: Job.objects.get(pk=job.pk).status == Job.CANCELLED, timeout=30, what="the abandon")
    finally:
        RELEASE.set()
        worker.stop()
        thread.join(30)
    row = Job.objects.get(pk=job.pk)
    assert row.result is None  # its late return was fenced out
    assert "abandoned" in JobError.objects.get(job_id=job.pk).message


def test_a_suspended_job_is_cancelled_at_once_and_an_ended_one_not_at_all():
    job = push("de.approval", {})
    drain()
    assert Job.objects.get(pk=job.pk).waiting_for == "event:approved"
    assert cancel([job.pk], running=True) == 1  # waiting, not running: cancelled now
    assert Job.objects.get(pk=job.pk).status == Job.CANCELLED
    assert cancel([job.pk], running=True) == 0
    with pytest.raises(ValueError):
        send_event(job.pk, "approved")
    assert nothing_sent()
