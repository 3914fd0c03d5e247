"""Django's Tasks framework on the leases queue: enqueue, run, results, errors, signals."""
from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from leases.clock import db_now
from leases.tasks.backend import (
    DatabaseBackend,
    InvalidTaskError,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
    task_finished,
    task_started,
)
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from tests import tasks_demo

pytestmark = pytest.mark.django_db(transaction=True)


def run_worker(queues=("default",)) -> None:
    worker = JobWorker(queues=list(queues), concurrency=2, burst=True, ttl=5)
    worker.run()


def test_enqueue_is_a_waiting_job_and_a_ready_result():
    result = tasks_demo.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY and result.backend == "default"
    job = Job.objects.get(pk=int(result.id))
    assert (job.name, job.backend, job.payload) == ("tests.tasks_demo.add", "default", {"args": [2, 3], "kwargs": {}})
    assert job.max_attempts == 3  # from the demo project's OPTIONS
    assert tasks_demo.add.get_result(result.id).status == TaskResultStatus.READY
    tasks_demo.add.enqueue(2, 3)
    assert Job.objects.count() == 2  # tasks are never deduped


def test_a_real_worker_runs_tasks_end_to_end(manage, child_env):
    ok = tasks_demo.add.enqueue(2, 3)
    bad = tasks_demo.explode.enqueue(7)
    asynchronous = tasks_demo.async_add.enqueue(a=4, b=5)
    Job.objects.filter(pk=int(bad.id)).update(max_attempts=1)  # retries: see the signals test
    done = subprocess.run(
        [*manage, "leases_worker", "--burst", "--queue", "default", "--import", "tests.tasks_demo", "-v", "0"],
        env=child_env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ok.refresh()
    assert ok.status == TaskResultStatus.SUCCESSFUL and ok.return_value == 5
    assert ok.finished_at >= ok.started_at >= ok.enqueued_at
    assert len(ok.worker_ids) == 1 and not ok.errors
    assert tasks_demo.async_add.get_result(asynchronous.id).return_value == 9
    failed = tasks_demo.explode.get_result(bad.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in failed.errors] == [ValueError]
    assert "exploded 7" in failed.errors[-1].traceback
    assert failed.worker_ids == ok.worker_ids and failed.attempts == 1
    with pytest.raises(ValueError):
        failed.return_value


def test_async_tasks_run_together_on_the_workers_event_loop():
    assert DatabaseBackend.supports_async_task
    results = [tasks_demo.async_where.enqueue(0.5) for _ in range(4)]
    worker = JobWorker(queues=["default"], concurrency=4, burst=True, ttl=5)
    worker.run()
    values = []
    for result in results:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL, result.errors
        values.append(result.return_value)
        assert (values[-1]["thread"], values[-1]["job"]) == ("leases-loop", int(result.id))
    assert max(v["began"] for v in values) < min(v["ended"] for v in values)  # all four awaited at once


def test_a_durable_sleep_on_the_last_attempt_is_not_the_tasks_end():
    finished = []

    def receiver(sender, task_result, **kwargs):
        finished.append(task_result.status)

    result = tasks_demo.durable_nap.enqueue(0.2)
    Job.objects.filter(pk=int(result.id)).update(max_attempts=1)
    task_finished.connect(receiver)
    try:
        run_worker()  # the first run suspends; the burst waits for the sleep's end and runs it again
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "rested"
    assert finished == [TaskResultStatus.SUCCESSFUL]


def test_context_sees_the_attempt_number():
    result = tasks_demo.which_attempt.enqueue(fail_until=2)
    Job.objects.filter(pk=int(result.id)).update(max_attempts=3)
    for _ in range(3):
        Job.objects.filter(pk=int(result.id), status=Job.READY).update(run_at=db_now() - timedelta(seconds=1))
        run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 2
    assert len(result.errors) == 1


def test_defer_and_priority():
    later = tasks_demo.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 1)
    first = tasks_demo.add.enqueue(1, 2)
    high = tasks_demo.urgent.enqueue("hi")
    worker = JobWorker(queues=["default"], ttl=5)
    worker.register()
    claimed = [job.id for job in worker.claim(10)]
    assert claimed == [int(high.id), int(first.id)]
    assert Job.objects.get(pk=int(later.id)).status == Job.READY


def test_bad_tasks_are_refused_and_write_nothing():
    with pytest.raises(InvalidTaskError, match="JSON"):
        tasks_demo.add.enqueue(object(), 1)
    with pytest.raises(InvalidTaskError):
        tasks_demo.add.using(priority=101).enqueue(1, 1)
    with pytest.raises(InvalidTaskError):
        tasks_demo.add.using(queue_name="nowhere").enqueue(1, 1)
    assert not Job.objects.exists()
    with pytest.raises(TaskResultDoesNotExist):
        tasks_demo.add.get_result("12345")
    with pytest.raises(TaskResultDoesNotExist):
        tasks_demo.add.get_result("not-a-number")


def test_signals_fire_once_per_task_outcome():
    seen = []

    def record(signal_name):
        def receiver(sender, task_result, **kwargs):
            seen.append((signal_name, task_result.task.name, task_result.status))

        return receiver

    receivers = [(s, record(n)) for s, n in ((task_enqueued, "enqueued"), (task_started, "started"), (task_finished, "finished"))]
    for signal, receiver in receivers:
        signal.connect(receiver)
    try:
        tasks_demo.add.enqueue(1, 1)
        bad = tasks_demo.explode.enqueue(1)
        Job.objects.filter(pk=int(bad.id)).update(max_attempts=2)
        run_worker()
        Job.objects.filter(pk=int(bad.id), status=Job.READY).update(run_at=db_now() - timedelta(seconds=1))
        run_worker()
    finally:
        for signal, receiver in receivers:
            signal.disconnect(receiver)
    assert ("finished", "add", TaskResultStatus.SUCCESSFUL) in seen
    failed = tasks_demo.explode.get_result(bad.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in failed.errors] == [ValueError, ValueError] and failed.attempts == 2
    assert [s for s in seen if s[1] == "explode"] == [
        ("enqueued", "explode", TaskResultStatus.READY),
        ("started", "explode", TaskResultStatus.RUNNING),
        ("started", "explode", TaskResultStatus.RUNNING),
        ("finished", "explode", TaskResultStatus.FAILED),  # once: the retried attempt was not the end
    ]


def test_bad_options_are_a_configuration_error():
    with pytest.raises(ImproperlyConfigured, match="max_attempts"):
        DatabaseBackend("x", {"OPTIONS": {"max_attempts": 0}})
    with pytest.raises(ImproperlyConfigured, match="unknown option"):
        DatabaseBackend("x", {"OPTIONS": {"retries": 3}})
