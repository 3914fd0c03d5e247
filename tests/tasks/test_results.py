"""Waiting on a job's result (`Job.wait`, `leases.tasks.wait`), in one process: the
handler's result once the job succeeded, whatever its JSON; JobFailed naming the status
for a job that failed, died, was cancelled or deleted; TimeoutError for one that has not
ended, `wait(0)` reading once; and on PostgreSQL the waiter woken by NOTIFY when the job
ends, not by its next poll."""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from leases.clock import db_now
from leases.exceptions import JobFailed
from leases.tasks import Fail, handler, push, wait
from leases.tasks.jobs import results
from leases.tasks.jobs.actions import cancel, discard
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

QUEUE = "results"


@handler("res.echo", queue=QUEUE)
def echo(payload):
    return payload["value"]


@handler("res.durable", queue=QUEUE)
def durable(payload, ctx):
    return ctx.step("answer", lambda: {"answer": payload["value"]})


@handler("res.refuse", queue=QUEUE, max_attempts=3)
def refuse(payload):
    raise Fail("refused")


@handler("res.boom", queue=QUEUE, max_attempts=1)
def boom(payload):
    raise RuntimeError("boom")


def drain() -> None:
    JobWorker(queues=[QUEUE], concurrency=2, ttl=5, burst=True, poll=0.01).run()


def in_thread(target) -> tuple[threading.Thread, dict]:
    """Run `target()` in a thread of its own; what it returned or raised lands in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("value", [{"a": [1, 2]}, "text", 7, None, [None, True]])
def test_wait_returns_the_result_of_a_succeeded_job(value):
    job = push("res.echo", {"value": value})
    drain()
    assert job.wait(5) == value
    assert wait(job.pk, timeout=5) == value  # by id, through the API's name


def test_a_waiter_gets_the_result_when_a_worker_ends_the_job_meanwhile():
    job = push("res.durable", {"value": 42}, delay=0.5)
    waiter, out = in_thread(lambda: wait(job.pk, timeout=60))
    wait_for(lambda: drain() or Job.objects.get(pk=job.pk).status == Job.SUCCEEDED, timeout=30, what="the job")
    waiter.join(60)
    assert not waiter.is_alive() and out == {"value": {"answer": 42}}


@pytest.mark.parametrize("name, status", [("res.refuse", "failed"), ("res.boom", "dead")])
def test_wait_raises_job_failed_with_the_status_of_a_job_that_ended_badly(name, status):
    job = push(name, {})
    drain()
    with pytest.raises(JobFailed) as raised:
        job.wait(5)
    assert (raised.value.status, str(raised.value)) == (status, f"job #{job.pk} {status}")


def test_wait_raises_job_failed_for_a_cancelled_or_deleted_job():
    cancelled = push("res.echo", {"value": 1}, delay=600)
    assert cancel([cancelled.pk]) == 1
    with pytest.raises(JobFailed) as raised:
        wait(cancelled, timeout=5)
    assert raised.value.status == "cancelled"
    gone = push("res.echo", {"value": 2}, delay=600)
    assert discard([gone.pk]) == 1
    with pytest.raises(JobFailed) as raised:
        gone.wait(5)
    assert (raised.value.status, str(raised.value)) == ("deleted", f"job #{gone.pk} was deleted")


def test_wait_raises_timeout_error_for_a_job_that_has_not_ended():
    job = push("res.echo", {"value": 1}, delay=600)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=f"job #{job.pk} has not ended after 0.3s"):
        job.wait(0.3)
    assert time.monotonic() - began >= 0.3
    assert Job.objects.get(pk=job.pk).status == Job.READY  # a wait changes nothing


def test_wait_zero_reads_once():
    job = push("res.echo", {"value": "x"}, delay=600)
    with CaptureQueriesContext(connection) as seen, pytest.raises(TimeoutError):
        job.wait(0)
    assert len(seen.captured_queries) == 1
    Job.objects.filter(pk=job.pk).update(status=Job.SUCCEEDED, result="done", finished_at=db_now())
    with CaptureQueriesContext(connection) as seen:
        assert job.wait(0) == "done"
    assert len(seen.captured_queries) == 1


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), "5", None])
def test_a_bad_timeout_is_one_line(timeout):
    job = push("res.echo", {"value": 1})
    with pytest.raises(ValueError) as raised:
        job.wait(timeout)
    assert "timeout" in str(raised.value) and "\n" not in str(raised.value)


def test_on_postgresql_the_waiter_is_woken_by_notify_not_by_its_next_poll(monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL notifies the ends of jobs; elsewhere waiters poll")
    calls: list[tuple[float, float]] = []  # (seconds asked, seconds it took) of each pause
    entered = threading.Event()
    listening = []
    real = results._Listener.wait

    def long_pause(self, job_id: int, seconds: float) -> None:
        listening.append(self.connection is not None)
        entered.set()
        began = time.monotonic()
        real(self, job_id, 30.0)  # a poll would wait all of this
        calls.append((30.0, time.monotonic() - began))

    monkeypatch.setattr(results._Listener, "wait", long_pause)
    job = push("res.echo", {"value": "woken"}, delay=600)
    waiter, out = in_thread(lambda: wait(job.pk, timeout=120))
    assert entered.wait(30)
    Job.objects.filter(pk=job.pk).update(run_at=db_now())
    drain()  # its ending's transaction notifies
    waiter.join(60)
    assert not waiter.is_alive() and out == {"value": "woken"}
    assert listening and all(listening)  # the waiter had its own listening connection
    assert calls and calls[-1][1] < 20.0  # woken well before the pause's end


def test_the_listener_connection_is_closed_after_the_wait(monkeypatch):
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL waiters hold a connection of their own")
    job = push("res.echo", {"value": 1})
    drain()
    seen = []
    real = results._Listener.close

    def close(self) -> None:
        seen.append(self.connection is not None)
        real(self)
        seen.append(self.connection)

    monkeypatch.setattr(results._Listener, "close", close)
    assert job.wait(5) == 1
    assert seen == [True, None]


def test_an_id_that_names_no_job_is_no_job_not_a_deleted_one(monkeypatch):
    """`wait(99999)` said "job #99999 was deleted" (JobFailed) of an id that never named a
    job; `jobs wait 99999` says "no job #99999". A job whose row goes while it is waited
    for, by id too, is still JobFailed "deleted"."""
    job = push("res.echo", {"value": 1}, delay=600)
    missing = job.pk + 1000
    with pytest.raises(Job.DoesNotExist, match=rf"^no job #{missing}$"):
        wait(missing, timeout=5)
    # Deleted after the wait's first read found it (at its first pause).
    monkeypatch.setattr(results._Listener, "wait", lambda self, job_id, seconds: discard([job_id]))
    with pytest.raises(JobFailed) as raised:
        wait(job.pk, timeout=5)
    assert (raised.value.status, str(raised.value)) == ("deleted", f"job #{job.pk} was deleted")


@pytest.mark.parametrize("value", [0, -3, 2**63, True, "12", 1.5])
def test_a_bad_job_id_is_one_line(value):
    with pytest.raises(ValueError, match=r"^a job id is a whole number from 1 to \d+, not .+$"):
        wait(value, timeout=1)
