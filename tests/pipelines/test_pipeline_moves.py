"""How a pipeline run moves on, driven by in-process burst workers: the advance event that
follows each task's end is idempotent; a stage's end moves its run in the same
transaction unless another step holds the run (then the event does, without waiting);
the claim reads what pipeline handlers need in one statement; resume repairs a run whose
event was lost; operators' actions on a task's job end its stage.
"""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from leases import db
from leases.clock import db_now
from leases.pipelines import Pipeline, Stage, machine, payload
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.pipelines.payload import task_payload
from leases.tasks import queue as jobqueue
from leases.tasks import registry
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from tests import pipes
from tests.pipes import drain, stages

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

EVENT = machine.EVENT


@pytest.fixture
def events_only(monkeypatch):
    """As if another step held every run whenever a task ended: runs move on only by their
    advance events."""
    monkeypatch.setattr("leases.pipelines.outcomes._advance_here", lambda cursor, run_ids, now: [])


def test_an_event_delivered_twice_moves_the_run_once(events_only):
    run = pipes.three.start()
    JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
    a = stages(run)["a"]
    # Their outcomes were recorded as their jobs ended; the last one queued the run's event.
    assert (a.status, a.pending, a.done) == (StageRun.RUNNING, 0, 5)
    event = Job.objects.get(name=EVENT, status=Job.READY)
    assert (event.payload, event.key, event.pushes) == ({"run": run.pk}, f"{EVENT}:{run.pk}", 1)
    for _ in range(2):  # delivered twice, as after a lost reply
        machine.advance_event(run.pk)
    rows = stages(run)
    assert (rows["a"].status, rows["b"].status) == (StageRun.SUCCEEDED, StageRun.RUNNING)
    assert TaskRun.objects.filter(stage=rows["b"]).count() == 5  # started once
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_a_stage_end_moves_its_run_on_in_the_same_transaction():
    run = pipes.three.start()
    JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
    rows = stages(run)
    assert (rows["a"].status, rows["b"].status, rows["b"].total) == (StageRun.SUCCEEDED, StageRun.RUNNING, 5)
    assert Job.objects.filter(name__startswith="p.b").count() == 5 and not Job.objects.filter(name=EVENT).exists()


def test_a_claim_reads_its_tasks_for_their_handlers_with_one_statement(monkeypatch):
    run = pipes.three.start()
    batches, rows = [], []
    real_read, real_payload = payload.read_tasks, payload.task_payload

    def read(cursor, jobs):
        batches.append(sorted(job.name for job in jobs))
        real_read(cursor, jobs)

    def built(stored, using=None, row=None):
        rows.append(row)
        return real_payload(stored, using, row)

    monkeypatch.setattr(payload, "task_payload", built)
    registry.add_claim_reader(machine.BACKEND, read)
    try:
        JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
    finally:
        registry.add_claim_reader(machine.BACKEND, real_read)
    assert batches == [["p.a1", "p.a2", "p.a3", "p.a4", "p.a5"]]
    assert len(rows) == 5 and None not in rows  # no handler read its task again
    assert stages(run)["a"].status == StageRun.SUCCEEDED


def test_a_task_that_reads_no_results_uses_no_connection_in_its_thread(monkeypatch):
    from django.db.backends.base.base import BaseDatabaseWrapper

    from leases.pipelines import store

    run = pipes.three.start()
    store._DEFINITIONS.clear()  # a worker process that never saw the run: its definition is read by the claim
    opened, connect = [], BaseDatabaseWrapper.connect
    monkeypatch.setattr(BaseDatabaseWrapper, "connect",
                        lambda self: opened.append(threading.current_thread().name) or connect(self))
    JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
    assert stages(run)["a"].status == StageRun.SUCCEEDED
    assert "leases-job" not in opened


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has no row locks: a writer waits for the database")
@pytest.mark.parametrize("held", ["run", "stage"])
def test_a_stage_end_that_finds_its_run_held_leaves_it_to_the_event_without_waiting(held):
    run = pipes.three.start()
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:  # another step of the run, in a transaction of its own
        try:
            with db.write_transaction():
                rows = Run.objects.filter(pk=run.pk) if held == "run" else StageRun.objects.filter(run=run, name="c")
                assert len(rows.select_for_update()) == 1
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        begun = time.monotonic()
        JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
        assert time.monotonic() - begun < 5  # it did not wait for the holder
        a = stages(run)["a"]
        assert (a.status, a.pending, a.done) == (StageRun.RUNNING, 0, 5)
        assert Job.objects.get(name=EVENT).status == Job.READY
    finally:
        release.set()
        holder.join(30)
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_a_step_that_fails_at_a_stage_end_is_undone_alone_and_left_to_the_event(monkeypatch, caplog):
    run = pipes.three.start()
    monkeypatch.setattr("leases.pipelines.outcomes.advance", lambda *args: 1 / 0)
    JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()  # stage a's tasks
    # The tasks' ends are recorded as they were; the run waits for its event.
    assert set(TaskRun.objects.filter(stage__name="a").values_list("status", flat=True)) == {TaskRun.SUCCEEDED}
    assert Job.objects.get(name="p.a1").status == Job.SUCCEEDED
    assert (stages(run)["a"].status, Job.objects.get(name=EVENT).status) == (StageRun.RUNNING, Job.READY)
    assert f"pipeline run #{run.pk}: moving on at its task's end failed, its event retries: ZeroDivisionError" \
        in caplog.text
    monkeypatch.undo()
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_resume_repairs_a_run_whose_job_ended_unrecorded_or_whose_event_was_cancelled(events_only):
    run = pipes.three.start()
    # One of stage a's jobs is ended behind the queue's back: its outcome is not recorded.
    lost = TaskRun.objects.filter(stage=stages(run)["a"]).order_by("position").first()
    now = db_now()
    Job.objects.filter(pk=lost.job_id).update(status=Job.SUCCEEDED, result="by hand", started_at=now, finished_at=now)
    JobWorker(queues=["default"], concurrency=4, burst=True, poll=0.01).run()  # the other four
    assert stages(run)["a"].pending == 1 and not Job.objects.filter(name=EVENT).exists()  # stuck
    assert run.resume() is False  # it was running: nothing to resume, but it is repaired
    lost.refresh_from_db()
    assert (lost.status, lost.result) == (TaskRun.SUCCEEDED, "by hand")
    assert stages(run)["b"].status == StageRun.RUNNING
    # Stage b's tasks run, and an operator cancels the event the last of them queued.
    JobWorker(queues=["default"], concurrency=5, burst=True, max_jobs=5, poll=0.01).run()
    assert jobqueue.cancel(list(Job.objects.filter(name=EVENT, status=Job.READY).values_list("pk", flat=True))) == 1
    b = stages(run)["b"]
    assert (b.status, b.pending) == (StageRun.RUNNING, 0)  # stuck again
    run.resume()
    assert stages(run)["c"].status == StageRun.RUNNING
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_an_operator_cancelling_a_task_job_fails_its_stage():
    run = pipes.three.start()
    job = TaskRun.objects.filter(run=run).order_by("position").first().job_id
    assert jobqueue.cancel([job]) == 1
    # Recorded by the statement that cancelled it, which also queued the run's event.
    task = TaskRun.objects.get(job_id=job)
    assert (task.status, task.error) == (TaskRun.CANCELLED, "its job was cancelled")
    event = Job.objects.get(name=EVENT)
    assert (event.payload, event.queue, event.priority) == ({"run": run.pk}, "default", 100)
    drain()
    run.refresh_from_db()
    assert run.status == Run.FAILED and "its job was cancelled" in run.error


def test_discarding_a_waiting_task_job_fails_its_stage():
    run = pipes.three.start()
    job = TaskRun.objects.filter(run=run).order_by("position").first().job_id
    assert jobqueue.discard([job]) == 1
    drain()
    run.refresh_from_db()
    assert run.status == Run.FAILED and f"its job #{job} was deleted" in run.error


def test_a_job_out_of_attempts_after_its_worker_died_ends_its_task():
    once = Pipeline("t-once", [Stage("one", ["p.a1"])])
    run = once.start()
    task = TaskRun.objects.get(run=run)
    # A worker claimed its only attempt and died: the lease has lapsed.
    Job.objects.filter(pk=task.job_id).update(
        status=Job.RUNNING, attempt=3, max_attempts=3, claims=3, worker="gone", expires_at="2000-01-01T00:00:00Z",
    )
    assert JobWorker(queues=["default"], burst=True).recover() == 1
    assert Job.objects.get(pk=task.job_id).status == Job.DEAD
    drain()
    run.refresh_from_db()
    assert run.status == Run.FAILED and "WorkerLost" in run.error


def test_a_task_of_an_ended_run_does_not_call_its_handler(tmp_path):
    log = tmp_path / "runs.log"
    run = pipes.three.start(context={"log": str(log)})
    stored = Job.objects.filter(name="p.a1").values_list("payload", flat=True).get()
    run.cancel()
    with pytest.raises(Exception, match="has cancelled"):
        task_payload(stored)
    assert not log.exists()
