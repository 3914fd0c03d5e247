"""A worker that does not serve a handler's queue says so: one warning when it starts,
naming the handlers and how to serve them, and, with --burst, one line before it exits
when it claimed nothing while jobs are due on queues it does not serve (one grouped read
then, none per poll)."""
from __future__ import annotations

import logging
import re

import pytest

import tests.jobs  # noqa: F401 - registers noop (queue default) and echo (queue other)
from leases.tasks import push
from leases.tasks.worker import JobWorker, report

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def warnings(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "leases.tasks.worker" and r.levelno == logging.WARNING and words in r.getMessage()]


def burst(*queues: str) -> JobWorker:
    worker = JobWorker(queues=list(queues), burst=True, poll=0.01)
    worker.run()
    return worker


def test_a_worker_names_the_handlers_whose_queues_it_does_not_serve(caplog):
    caplog.set_level(logging.INFO, logger="leases")
    worker = burst("default")
    [line] = warnings(caplog, "not those of handlers")
    assert line.startswith(f"worker {worker.name} serves queues default, not those of handlers ")
    # The first NAMES_SHOWN of them by name (other test modules register handlers too), and a count
    unserved = worker.unserved_handlers()
    named = ", ".join(f"{spec.name} ({spec.queue})" for spec in unserved[:report.NAMES_SHOWN])
    assert f"not those of handlers {named}" in line and "noop (" not in line
    if len(unserved) > report.NAMES_SHOWN:
        assert f" and {len(unserved) - report.NAMES_SHOWN} more:" in line
    assert "leases.pipelines" not in line  # start's queue is default; advance is internal
    suggested = re.search(r"their jobs wait for another worker; to serve them too,"
                          r" --queue (\S+) or --queue '\*'$", line)
    assert suggested and {"default", "other"} <= set(suggested.group(1).split(","))
    assert {spec.name for spec in worker.unserved_handlers()} >= {"echo"}
    assert not {spec.name for spec in worker.unserved_handlers()} & {"noop", "leases.pipelines.advance"}
    caplog.clear()
    burst("*")
    assert warnings(caplog, "not those of handlers") == []
    assert "echo" not in {spec.name for spec in JobWorker(queues=["default", "other"]).unserved_handlers()}


def test_a_burst_worker_that_claimed_nothing_says_where_jobs_are_due(caplog, monkeypatch):
    from leases.tasks.jobs import counts

    caplog.set_level(logging.INFO, logger="leases")
    calls = []
    counted = counts.due_elsewhere
    monkeypatch.setattr(counts, "due_elsewhere", lambda *args: calls.append(args) or counted(*args))
    push("echo", {"n": 1})
    push("echo", {"n": 2})
    push("noop", {}, delay=600)  # its own queue's, and not due
    worker = burst("default")
    assert worker.stats.claimed == 0 and len(calls) == 1  # one read, at the exit
    [line] = warnings(caplog, "claimed nothing")
    assert line == (f"worker {worker.name} claimed nothing, but queues it does not serve have jobs due:"
                    " other (2); serve them with --queue default,other or --queue '*'")
    caplog.clear()
    push("noop", {})
    assert burst("default").stats.claimed == 1 and warnings(caplog, "claimed nothing") == []
    assert burst("other").stats.claimed == 2
    # Nothing due elsewhere: nothing to say.
    assert burst("default").stats.claimed == 0 and warnings(caplog, "claimed nothing") == []
    assert len(calls) == 2  # the workers that claimed something did not look
