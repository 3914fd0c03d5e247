"""What the worker says: one line per job outcome with its queue, attempt and run time, the
jobs a recovery took back, timestamps by default, JSON for log shippers, no line twice."""
from __future__ import annotations

import io
import json
import logging
from datetime import timedelta

import pytest

import tests.jobs  # noqa: F401 - registers noop, boom, refuse
from leases import logs
from leases.clock import db_now
from leases.tasks import push
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def drain() -> None:
    JobWorker(queues=["default"], concurrency=1, burst=True, poll=0.01).run()


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "leases.tasks.worker" and "job " in r.getMessage()]


def test_one_line_per_outcome_says_what_happened(caplog):
    caplog.set_level(logging.INFO, logger="leases")
    ok, boom, refused = push("noop", {"n": 1}), push("boom", {"n": 2}), push("refuse", {"n": 3})
    drain()
    said = lines(caplog)
    assert any(line.startswith(f"job noop #{ok.pk} on default succeeded in ") and line.endswith("(attempt 1/3)")
               for line in said)
    assert any(line.startswith(f"job boom #{boom.pk} on default failed in ") and "(attempt 1/3), retry in 0.0s:"
               in line and line.endswith("RuntimeError: boom 2") for line in said)
    assert any(f"job boom #{boom.pk} on default failed in " in line and "(attempt 3/3), dead: out of attempts:"
               in line for line in said)
    assert any(f"job refuse #{refused.pk} on default failed in " in line and "(attempt 1/5), not retried:"
               in line and "Fail: bad payload" in line for line in said)
    records = [r for r in caplog.records if getattr(r, "job_id", None) == ok.pk]
    assert [(r.levelname, r.outcome, r.queue, r.attempt) for r in records] == [("INFO", "succeeded", "default", 1)]


def test_a_recovery_names_the_jobs_it_took_back(caplog):
    caplog.set_level(logging.WARNING, logger="leases")
    job = push("noop", {"n": 1})
    Job.objects.filter(pk=job.pk).update(status=Job.RUNNING, attempt=1, claims=1, worker="gone:1:aa",
                                         expires_at=db_now() - timedelta(seconds=5))
    assert JobWorker(queues=["default"]).recover() == 1
    [line] = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert line.endswith(f"recovered 1 job(s) whose worker stopped heartbeating: noop #{job.pk} of gone:1:aa"
                         " (ready again)")


@pytest.fixture
def leases_logger():
    """The `leases` logger as the test found it, put back after."""
    logger = logging.getLogger("leases")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers, logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_without_logging_settings_the_worker_prints_timestamped_info_lines_once(leases_logger):
    leases_logger.handlers = []
    logs.configure("plain", verbosity=1)
    logs.configure("plain", verbosity=1)  # a second call adds nothing
    assert len(leases_logger.handlers) == 1 and not leases_logger.propagate
    assert leases_logger.level == logging.INFO
    stream = io.StringIO()
    leases_logger.handlers[0].setStream(stream)
    logging.getLogger("leases.tasks.worker").info("job x #1 on default succeeded in 3ms (attempt 1/3)")
    [line] = stream.getvalue().splitlines()
    assert line.endswith("INFO leases.tasks.worker: job x #1 on default succeeded in 3ms (attempt 1/3)")
    assert line[:4].isdigit() and line[4] == "-"  # a timestamp first


def test_a_projects_logging_handlers_are_kept_and_json_replaces_them(leases_logger):
    mine = logging.StreamHandler(io.StringIO())
    leases_logger.handlers = [mine]
    logs.configure("plain", verbosity=1)
    assert leases_logger.handlers == [mine]
    logs.configure("json", verbosity=2)
    [handler] = leases_logger.handlers
    assert isinstance(handler.formatter, logs.JsonFormatter) and leases_logger.level == logging.DEBUG
    stream = io.StringIO()
    handler.setStream(stream)
    logging.getLogger("leases.tasks.worker").info("job noop #7 succeeded", extra={"job_id": 7, "outcome": "succeeded"})
    line = json.loads(stream.getvalue())
    assert (line["level"], line["logger"], line["job_id"], line["outcome"]) == ("INFO", "leases.tasks.worker", 7,
                                                                                 "succeeded")
    assert line["message"] == "job noop #7 succeeded" and line["time"].endswith("+00:00")


def test_the_stop_line_tells_failed_attempts_from_jobs_that_failed_for_good(caplog):
    caplog.set_level(logging.INFO, logger="leases")
    push("noop", {"n": 1})
    push("boom", {"n": 2})  # three attempts: retried twice, then dead
    push("refuse", {"n": 3})  # Fail: not retried
    worker = JobWorker(queues=["default"], concurrency=1, burst=True, poll=0.01)
    stats = worker.run()
    [line] = [r.getMessage() for r in caplog.records if " stopped: " in r.getMessage()]
    assert line == (f"worker {worker.name} stopped: 5 claimed: 1 succeeded, 2 retried, 2 failed for good; 0 jobs"
                    " of stopped workers recovered")
    assert (stats.failed, stats.retried, stats.ended) == (4, 2, 2)
    # What `jobs stats` counts as failed and dead:
    assert Job.objects.filter(status__in=[Job.DEAD, Job.FAILED]).count() == stats.ended
