"""Poison in the job queue, in one process: handlers that raise or return what the
database cannot take, outcomes the database refuses, bad pushes. Each must end as one
job's clear failure (or a clear ValueError at push time), never as a dead or frozen worker.

The multi-process faults (lost replies, outages) are in test_faults.py.
"""
from __future__ import annotations

import logging
import subprocess
from datetime import datetime, timezone

import pytest
from django.db import connection

import tests.jobs  # noqa: F401 - registers noop, boom, echo
from leases.exceptions import UnknownHandler
from leases.tasks import handler, push, push_many
from leases.tasks import queue as jobqueue
from leases.tasks.jobs.outcomes import Outcome
from leases.tasks.models import Job, JobError, Queue
from leases.tasks.worker import JobWorker, execute, handler_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED = range(6)
BAD_RESULT = "leases.exceptions.BadResult"


def drain(queues=("default",)) -> JobWorker:
    w = JobWorker(queues=list(queues), concurrency=4, ttl=5, burst=True)
    w.run()
    return w


def only_error(job) -> JobError:
    (error,) = JobError.objects.filter(job_id=job.pk)
    return error


# -- what handlers raise ------------------------------------------------------------------


class Strange(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@handler("poison.surrogate", max_attempts=1)
def raise_surrogate(payload):
    raise ValueError("lone \ud800 surrogate in the message")


@handler("poison.unprintable", max_attempts=1)
def raise_unprintable(payload):
    raise Strange()


@handler("poison.exit", max_attempts=1)
def raise_exit(payload):
    raise SystemExit(3)


@handler("poison.huge-message", max_attempts=1)
def raise_huge(payload):
    raise RuntimeError("m" * 20_000_000)


def long_class() -> type:
    """An exception class whose path is far over the column's 255 characters."""
    cls = type("E" * 300, (Exception,), {})
    cls.__module__ = "tests." + "deep." * 40 + "module"
    return cls


LONG = long_class()


@handler("poison.long-class", max_attempts=1)
def raise_long_class(payload):
    raise LONG("long class path")


def test_an_async_generator_is_refused_at_registration_with_what_to_do():
    """Its call would return an async iterator, never run, and each of its jobs would fail
    for good; an `async def` that returns is a handler the worker awaits."""
    async def fetch(payload):
        yield payload

    with pytest.raises(ValueError, match=r"^handler 'crawl\.async': .*fetch is an async generator.*async def"):
        handler("crawl.async")(fetch)
    with pytest.raises(UnknownHandler):
        push("crawl.async", {})


def test_odd_exceptions_fail_their_job_and_the_worker_goes_on():
    jobs = {name: push(name, {}) for name in (
        "poison.surrogate", "poison.unprintable", "poison.exit", "poison.huge-message", "poison.long-class",
    )}
    innocent = push("noop", {"n": 1})
    stats = drain().stats
    assert (stats.failed, stats.succeeded) == (5, 1)
    assert Job.objects.get(pk=innocent.pk).status == SUCCEEDED
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs.values()]).values_list("status", flat=True)) == {DEAD}
    assert only_error(jobs["poison.surrogate"]).message == "lone \\ud800 surrogate in the message"
    assert only_error(jobs["poison.unprintable"]).message == "<Strange.__str__ failed>"
    assert only_error(jobs["poison.exit"]).exception == "builtins.SystemExit"
    huge = only_error(jobs["poison.huge-message"])
    assert len(huge.message) <= 10_000 and "characters cut" in huge.message
    assert len(huge.traceback) <= 50_000
    long = only_error(jobs["poison.long-class"])
    assert len(long.exception) <= 255 and long.exception.startswith("tests.deep.") and long.message == "long class path"


# -- what handlers return -----------------------------------------------------------------


@handler("poison.datetime", max_attempts=3)
def return_datetime(payload):
    return datetime.now(timezone.utc)


@handler("poison.big", max_attempts=3)
def return_big(payload):
    return "x" * (20 << 20)


@handler("poison.deep", max_attempts=3)
def return_deep(payload):
    value: object = 1
    for _ in range(40):
        value = [value]
    return value


@handler("poison.surrogate-result", max_attempts=3)
def return_surrogate(payload):
    return {"text": "\udfff"}


def test_a_result_that_cannot_be_stored_fails_the_job_once_without_retries():
    """Running the handler again would repeat its work, so there is no second try."""
    names = ("poison.datetime", "poison.big", "poison.deep", "poison.surrogate-result")
    jobs = {name: push(name, {}) for name in names}
    innocent = push("noop", {"n": 2})
    drain()
    assert Job.objects.get(pk=innocent.pk).status == SUCCEEDED
    for name, job in jobs.items():
        row = Job.objects.get(pk=job.pk)
        assert (row.status, row.attempt, row.result) == (FAILED, 1, None), name
        assert only_error(job).exception == BAD_RESULT, name
    assert "not JSON serializable" in only_error(jobs["poison.datetime"]).message
    assert "over the limit" in only_error(jobs["poison.big"]).message
    assert "nested deeper" in only_error(jobs["poison.deep"]).message
    assert "lone surrogate" in only_error(jobs["poison.surrogate-result"]).message


def broken_backoff(attempt: int) -> float:
    raise ZeroDivisionError("backoff bug")


@handler("poison.backoff", max_attempts=2, backoff=broken_backoff)
def flaky_with_broken_backoff(payload):
    raise RuntimeError("try again")


def test_a_broken_backoff_still_retries_with_the_default(caplog):
    push("poison.backoff", {})
    w = JobWorker(queues=["default"], concurrency=1, ttl=5)
    w.register()
    (claimed,) = w.claim(1)
    claimed.handler = handler_for(claimed)
    outcome = execute(claimed)
    assert (outcome.ok, outcome.retryable) == (False, True)
    assert 5.0 <= outcome.delay <= 10.0  # the default backoff's first step
    assert "backoff" in caplog.text and "ZeroDivisionError" in caplog.text


# -- outcomes the database refuses --------------------------------------------------------


def claim_all(w: JobWorker, count: int) -> list:
    claimed = w.claim(count)
    w.running = {job.id: job for job in claimed}
    return sorted(claimed, key=lambda job: job.id)


def test_a_refused_outcome_fails_its_job_and_the_others_are_written(caplog):
    jobs = [push("noop", {"n": n}) for n in range(3)]
    w = JobWorker(queues=["default"], concurrency=4, ttl=5)
    w.register()
    first, poisoned, third = claim_all(w, 3)
    w._flush([
        Outcome(first, ok=True, result='"fine"'),
        Outcome(poisoned, ok=True, result="{not json"),  # bypasses every check: the CHECK refuses it
        Outcome(third, ok=False, error=("builtins.RuntimeError", "boom", ""), delay=0.0),
    ])
    assert w._pending == []
    rows = {row.pk: row for row in Job.objects.filter(pk__in=[j.pk for j in jobs])}
    assert (rows[first.id].status, rows[first.id].result) == (SUCCEEDED, "fine")
    assert rows[poisoned.id].status == FAILED
    error = only_error(rows[poisoned.id])
    assert error.exception == BAD_RESULT and "refused" in error.message
    assert rows[third.id].status == READY  # retried as its handler says
    assert "refused the outcome of noop" in caplog.text


def test_a_refused_error_record_still_ends_its_attempt():
    """A class path over the column (MySQL refuses it) is replaced by one that fits."""
    job = push("noop", {"n": 1})
    w = JobWorker(queues=["default"], concurrency=4, ttl=5)
    w.register()
    (claimed,) = claim_all(w, 1)
    w._flush([Outcome(claimed, ok=False, error=("x" * 300, "boom", ""), retryable=False)])
    row = Job.objects.get(pk=job.pk)
    assert row.status == FAILED and w._pending == []
    stored = only_error(row).exception
    if connection.vendor != "sqlite":
        assert stored == BAD_RESULT
    else:  # SQLite does not enforce lengths: the record is kept as it came
        assert stored == "x" * 300


# -- bad pushes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"queue": "defualt"}, "unknown queue 'defualt'"),
        ({"run_at": datetime(1, 1, 1, tzinfo=timezone.utc)}, "run_at must be within"),
        ({"run_at": datetime(9999, 1, 1, tzinfo=timezone.utc)}, "run_at must be within"),
        ({"delay": 1e12}, "delay must be at most"),
        ({"key": "lone\ud800"}, "lone surrogate"),
        ({"queue": "bad\nname"}, "control"),
    ],
)
def test_bad_pushes_are_value_errors_and_write_nothing(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        push("noop", {"n": 1}, **kwargs)
    with pytest.raises(ValueError, match=problem):
        push_many([("noop", {"n": 0}), ("noop", {"n": 1}, kwargs)])
    assert not Job.objects.exists()
    assert not Queue.objects.exclude(name="default").exists()


@pytest.mark.parametrize(
    "payload, problem",
    [
        ({"text": "\ud800"}, "lone surrogate"),
        ({"n": float("inf")}, "JSON-serialisable"),
        (return_deep(None), "nested deeper"),
    ],
)
def test_payloads_the_database_would_refuse_are_value_errors(payload, problem):
    with pytest.raises(ValueError, match=problem):
        push("noop", payload)
    assert not Job.objects.exists()


def test_an_unknown_queue_anywhere_in_a_batch_writes_nothing():
    items = [("noop", {"n": n}) for n in range(2500)] + [("noop", {"n": -1}, {"queue": "nosuch"})]
    with pytest.raises(ValueError, match="unknown queue 'nosuch'"):
        push_many(items)
    assert not Job.objects.exists()


def test_a_queue_with_a_row_is_known():
    Queue.objects.create(name="crawl")
    assert push("noop", {}, queue="crawl").queue == "crawl"


# -- what push returns ----------------------------------------------------------------------


def test_a_merged_push_returns_the_waiting_job_as_stored_and_says_so(caplog):
    first = push("noop", {"n": 1}, key="site:example.com", delay=60)
    assert not first.merged
    caplog.set_level(logging.WARNING, logger="leases.tasks")
    again = push("echo", {"other": True}, key="site:example.com", priority=7)
    assert again.merged and again.pk == first.pk
    assert (again.name, again.payload, again.queue, again.priority, again.pushes) == ("noop", {"n": 1}, "default", 7, 2)
    assert again.run_at < first.run_at  # moved to the new run time
    row = Job.objects.get()
    assert (row.name, row.priority, row.pushes) == ("noop", 7, 2)
    assert "merged into waiting job noop" in caplog.text
    caplog.clear()
    same = push("noop", {"n": 1}, key="site:example.com")
    assert same.merged and "merged" not in caplog.text  # the same work: nothing to warn about


def test_operator_retry_of_a_dead_job_gives_exactly_one_more_try():
    job = push("boom", {"n": 1})  # max_attempts=3
    drain()
    assert Job.objects.get(pk=job.pk).status == DEAD
    assert jobqueue.retry([job.pk]) == 1
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt, row.max_attempts) == (READY, 3, 4)
    drain()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt, row.max_attempts) == (DEAD, 4, 4)
    assert JobError.objects.filter(job=row).count() == 4


# -- the worker command's bad input -----------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--ttl", "0.001"], "--ttl must be"),
        (["--ttl", "1e12"], "--ttl must be at most"),
        (["--poll", "0"], "--poll must be"),
        (["--grace", "-1"], "--grace must be"),
        (["--concurrency", "100000"], "--concurrency must be at least 1 and at most 1000"),
        (["--import", "broken_handlers"], "--import broken_handlers: SyntaxError"),
    ],
)
def test_the_worker_command_refuses_bad_values_in_one_line(manage, child_env, tmp_path, args, needle):
    (tmp_path / "broken_handlers.py").write_text("def broken(:\n")
    env = {**child_env, "PYTHONPATH": f"{child_env['PYTHONPATH']}:{tmp_path}"}
    argv = [*manage, "leases_worker", "--burst", *args]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_the_loop_survives_a_closed_connection_that_outlasts_the_retries(monkeypatch, caplog):
    """The driver's "(0, '')" is Django's InterfaceError, which is no DatabaseError."""
    from django.db import InterfaceError

    push("noop", {"n": 1})
    failures = iter([InterfaceError(0, "")])

    def recover_once_broken(self):
        for exc in failures:
            raise exc
        return 0

    monkeypatch.setattr(JobWorker, "recover", recover_once_broken)
    stats = drain().stats
    assert stats.succeeded == 1 and "database error" in caplog.text
