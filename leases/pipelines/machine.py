"""The state machine of runs, stages and tasks: what a run's recorded outcomes allow next.

Every step that moves a run (the advance event, and start, cancel, pause, resume, restart
in `runs`) is one transaction that locks the run's row first (`store.locked`), so steps
of one run never interleave; each transition is a conditional UPDATE whose row count
decides (a task leaves "queued" once, a stage leaves "running" once). A crash anywhere
rolls its transaction back, and the queue runs the event again.

Each task is an ordinary job of its handler, made by the one maker of job rows (so its
queue, attempts, backoff, timeout and limits are the handler's), marked with `backend =
BACKEND` so the worker builds the handler's payload when it runs, and with `on_finish =
TASK_ENDED`: the transaction that ends the job for good records the task (`outcomes`).
"""
from __future__ import annotations

import logging
from datetime import datetime
from functools import partial
from typing import Any

from django.db import connections, transaction
from django.db.models import F, Min, Subquery

from leases import clock, db
from leases.encoding import load_json
from leases.sql import update_each
from leases.tasks import registry
from leases.tasks.jobs.actions import cancel as cancel_jobs
from leases.tasks.jobs.push import new_job, write

from . import payload, signals, sql, store
from .definition import CONTINUE, Stage
from .models import Run, StageRun, TaskRun

log = logging.getLogger("leases.pipelines")

#: `Job.backend` of a pipeline task's job: the worker runs it through `payload.task_runner`.
BACKEND = "leases.pipelines"
#: The on_finish of a task's job: its end is recorded by `outcomes.tasks_ended`.
TASK_ENDED = "leases.pipelines.task_ended"
#: The handler of the event that advances a run (leases.pipelines.handlers).
EVENT = "leases.pipelines.advance"
#: Attempts of an advance event: it must not be lost, and it is idempotent.
EVENT_ATTEMPTS = 1000
#: Task jobs pushed per INSERT, and ids per IN list.
CHUNK = 500


def advance_event(run_id: int, using: str | None = None) -> None:
    """The advance event: under the run's lock, do whatever its recorded outcomes allow.
    Idempotent, so a second delivery or a merged push changes nothing more."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> None:
        with db.write_transaction(using):
            run = store.locked(run_id, using)
            if run is not None:
                advance(run, clock.now(cursor), using)

    db.run(work, using)


def _usable(stage: StageRun, spec: Stage) -> bool:
    """Whether stages that require `stage` may start: it succeeded, or failed and its
    definition says to go on."""
    return stage.status == StageRun.SUCCEEDED or (stage.status == StageRun.FAILED and spec.on_failure == CONTINUE)


def advance(run: Run, now: datetime, using: str, stages: dict[str, StageRun] | None = None) -> None:
    """Do everything the run's state allows, under the run's lock: fail the run on a
    stage's failed task, finish stages whose tasks all finished, top up stages that queue
    their tasks a few at a time, start stages whose requirements are met, end the run.
    `stages`: its stages by name in definition order, when the caller locked and read them."""
    if run.status != Run.RUNNING:
        return
    specs, requires = store.definition(run)
    stages = stages if stages is not None else store.stages(run, using)
    moved = True
    while moved and run.status == Run.RUNNING:
        moved = False
        for name, stage in stages.items():
            if run.status != Run.RUNNING:
                return
            spec = specs[name]
            if stage.status == StageRun.WAITING and all(_usable(stages[need], specs[need]) for need in requires[name]) \
                    and (spec.wait_for is None or spec.wait_for in _events(run)):
                _start_stage(run, stage, spec, now, using)  # queues its first tasks
                moved = True
            if stage.status != StageRun.RUNNING:
                continue
            if stage.failed_tasks and spec.on_failure != CONTINUE:
                _stage_failed(run, stage, spec, _first_failure(stage, using), now, using)
            elif stage.pending == 0:
                _finish_stage(run, stage, now, using)
                moved = True
            elif stage.waiting:
                _top_up(run, stage, spec, now, using)
    if run.status == Run.RUNNING and all(
        stage.status in (StageRun.SUCCEEDED, StageRun.FAILED) for stage in stages.values()
    ):
        end_run(run, Run.SUCCEEDED, "", now, using)


def _events(run: Run) -> dict:
    """The run's events received (the locked row's column, read as stored)."""
    events = run.events
    return load_json(events) if isinstance(events, str) else (events or {})


def _tasks_of(run: Run, stage: StageRun, spec: Stage, items: list | None) -> list[TaskRun]:
    """The stage's tasks: its tasks in order, or for a for_each each task per item."""
    if items is None:
        return [TaskRun(run=run, stage=stage, task=task, position=index) for index, task in enumerate(spec.tasks)]
    width = len(spec.tasks)
    return [
        TaskRun(run=run, stage=stage, task=task, position=number * width + index, item_index=number, item=item)
        for number, item in enumerate(items)
        for index, task in enumerate(spec.tasks)
    ]


def _start_stage(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    """Make the stage's tasks (one per item for a for_each) and queue the first of them."""
    items: list | None = None
    if spec.for_each is not None:
        value = store.result(run.pk, store.definition(run)[0], spec.for_each, using)
        if not isinstance(value, list):
            StageRun.objects.using(using).filter(pk=stage.pk).update(status=StageRun.RUNNING, queued_at=now)
            stage.status, stage.queued_at = StageRun.RUNNING, now
            kind = "null" if value is None else type(value).__name__
            _stage_failed(run, stage, spec, f"for_each task {spec.for_each!r} returned {kind}, not a list", now, using)
            return
        items = value
    rows = _tasks_of(run, stage, spec, items)
    TaskRun.objects.using(using).bulk_create(rows, batch_size=CHUNK)
    count = len(rows)
    first = rows[: count if spec.limit is None else spec.limit]
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.pipeline(connection).stage_started,
                       [count, count, count - len(first), db.dialect(connection).stored_datetime(now), stage.pk])
        changed = cursor.rowcount
    if changed != 1:  # cannot happen under the run's lock; refuse rather than start twice
        raise RuntimeError(f"stage {stage.name!r} of run #{run.pk} was started by someone else")
    stage.status, stage.total, stage.pending, stage.queued_at = StageRun.RUNNING, count, count, now
    stage.waiting = count - len(first)
    if first and first[0].pk is None:  # the database did not return the new rows' keys
        first = list(
            TaskRun.objects.using(using).filter(stage=stage).order_by("position").only("pk", "task")[: len(first)]
        )
    for start in range(0, len(first), CHUNK):
        _queue(run, stage, first[start : start + CHUNK], now, using)


def _top_up(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    """Queue the stage's next waiting tasks, in order, up to its limit.

    `pending - waiting` is how many are queued. `pending` may have gone down since it
    was read (outcomes are recorded without the run's lock), which only leaves a slot
    free until the advance event the outcome queued tops it up again."""
    free = stage.waiting
    if spec.limit is not None:
        free = min(free, spec.limit - (stage.pending - stage.waiting))
    if free <= 0:
        return
    connection = connections[using]
    st = sql.pipeline(connection)
    with connection.cursor() as cursor:
        cursor.execute(st.next_waiting, [stage.pk, free])
        chosen = [TaskRun.from_db(using, ["id", "task"], row) for row in cursor.fetchall()]
    for start in range(0, len(chosen), CHUNK):
        _queue(run, stage, chosen[start : start + CHUNK], now, using)
    with connection.cursor() as cursor:
        cursor.execute(st.took_waiting, [len(chosen), stage.pk])
    stage.waiting -= len(chosen)


def _queue(run: Run, stage: StageRun, tasks: list[TaskRun], now: datetime, using: str) -> None:
    """Push the jobs of `tasks` and mark them queued, in the caller's transaction. Each
    job is made from its handler's settings; a limit key, target or affinity key that is a
    function of the payload is computed from what the handler will receive (its item, the
    run's context).
    Each carries the run's trace context, whichever process pushes it."""
    keyed = [task.pk for task in tasks if registry.get(task.task).keyed]
    received = payload.limit_payloads(run, stage.name, keyed, using) if keyed else {}
    new = [
        new_job(task.task, {"run": run.pk, "stage": stage.name, "task": task.pk}, key=f"pipeline:{run.pk}:{task.pk}",
                backend=BACKEND, on_finish=TASK_ENDED, handler_payload=partial(received.get, task.pk),
                traceparent=run.traceparent)
        for task in tasks
    ]
    connection = connections[using]
    with connection.cursor() as cursor:
        ids = write(cursor, new, ids=True)
    update_each(
        connection, db.table(TaskRun, connection), {task.pk: {"job_id": ids[job.key]} for task, job in zip(tasks, new)},
        fixed={"status": TaskRun.QUEUED.value, "queued_at": now},
    )


def _finish_stage(run: Run, stage: StageRun, now: datetime, using: str) -> None:
    """All the stage's tasks finished: it succeeded, or (on_failure="continue") failed
    saying why."""
    status = StageRun.FAILED if stage.failed_tasks else StageRun.SUCCEEDED
    error = (stage.error or _first_failure(stage, using)) if stage.failed_tasks else ""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.pipeline(connection).stage_ended, [
            status.value, db.dialect(connection).stored_datetime(now), error[:10000], stage.pk, stage.pk,
        ])
        ended = cursor.rowcount == 1
    if ended:
        stage.status, stage.finished_at, stage.error = status, now, error
        log.info("pipeline %s run #%d: stage %s %s (%d task(s))", run.pipeline, run.pk, stage.name, status, stage.total)
        after_commit(using, signals.stage_finished, run=run, stage=stage)


def _first_start(stage: StageRun) -> Subquery:
    """When the stage's first task started, as a subquery of the UPDATE that ends it."""
    tasks = TaskRun.objects.filter(stage_id=stage.pk).order_by().values("stage_id")
    return Subquery(tasks.annotate(first=Min("started_at")).values("first"))


def _first_failure(stage: StageRun, using: str) -> str:
    """What the stage's first failed task says, for the stage's and the run's error."""
    task = (
        TaskRun.objects.using(using).filter(stage=stage).exclude(status__in=(TaskRun.SUCCEEDED, TaskRun.WAITING,
                                                                              TaskRun.QUEUED))
        .order_by("finished_at", "position").only("task", "item_index", "status", "error").first()
    )
    if task is None:
        return "a task failed"
    label = task.task if task.item_index is None else f"{task.task} (item {task.item_index})"
    return f"task {label} {task.status}: {task.error}"


def _stage_failed(run: Run, stage: StageRun, spec: Stage, error: str, now: datetime, using: str) -> None:
    """The stage failed (a task of it failed for good, or its for_each had no list). With
    on_failure="continue" it goes on and fails when its tasks have finished; otherwise it
    fails now, and with it the run."""
    if spec.on_failure == CONTINUE:
        # A failed task was counted when it was recorded; a stage whose for_each had no
        # list has no tasks, and counts itself.
        extra = 0 if stage.total else 1
        StageRun.objects.using(using).filter(pk=stage.pk).update(
            failed_tasks=F("failed_tasks") + extra, error=error[:10000],
        )
        stage.failed_tasks += extra
        stage.error = error
        return
    end_run(run, Run.FAILED, f"stage {stage.name!r} failed: {error}", now, using, failed=(stage, error))


def end_run(run: Run, status: str, error: str, now: datetime, using: str,
            failed: tuple[StageRun, str] | None = None) -> bool:
    """Finish a live run: nothing new starts, waiting jobs are cancelled (their tasks
    are recorded as cancelled in the same statement); running tasks are asked to stop when
    the run is cancelled, and finish unheeded when it failed.
    `failed` names the stage that failed it; the other unfinished stages are cancelled.

    Jobs are cancelled before stage rows are touched: a worker recording an outcome
    holds its job's row and then wants its stage's, so the reverse order could deadlock.
    """
    connection = connections[using]
    st, stored = sql.pipeline(connection), db.dialect(connection).stored_datetime(now)
    with connection.cursor() as cursor:
        # A keyed run frees its key: a new run of the key may start.
        cursor.execute(st.end_run, [str(status), error[:10000], stored, bool(run.key), run.pk])
        if cursor.rowcount != 1:
            return False
        run.status, run.error, run.finished_at = status, error[:10000], now
        if run.key:
            run.live_key = None
        queued = []
        if status != Run.SUCCEEDED:  # a run succeeds once every stage ended: nothing waits or runs
            skipped = TaskRun.CANCELLED if status == Run.CANCELLED else TaskRun.SKIPPED
            cursor.execute(st.end_waiting, [skipped.value, stored, run.pk])
            cursor.execute(st.queued_jobs, [run.pk])
            queued = [job_id for (job_id,) in cursor.fetchall()]
    for start in range(0, len(queued), CHUNK):  # a cancelled run's running tasks are asked to stop too
        cancel_jobs(queued[start : start + CHUNK], using, running=status == Run.CANCELLED)
    if failed is not None:
        _fail_stage(run, *failed, now, using)
    _end_stages(run, now, using)
    log.log(
        logging.INFO if status == Run.SUCCEEDED else logging.WARNING,
        "pipeline %s run #%d %s%s", run.pipeline, run.pk, status, f": {error}" if error else "",
    )
    after_commit(using, signals.pipeline_finished, run=run)
    return True


def _fail_stage(run: Run, stage: StageRun, reason: str, now: datetime, using: str) -> None:
    """The stage that failed the run ends failed, saying why."""
    open_stage = StageRun.objects.using(using).filter(pk=stage.pk, status__in=(StageRun.WAITING, StageRun.RUNNING))
    if open_stage.update(
        status=StageRun.FAILED, error=reason[:10000], finished_at=now, started_at=_first_start(stage),
    ) == 1:
        stage.status, stage.error, stage.finished_at = StageRun.FAILED, reason, now
        after_commit(using, signals.stage_finished, run=run, stage=stage)


def _end_stages(run: Run, now: datetime, using: str) -> None:
    """The run's stages that had not ended are cancelled (a run that succeeded has none);
    the run started when its first task did."""
    connection = connections[using]
    st, stored = sql.pipeline(connection), db.dialect(connection).stored_datetime
    with connection.cursor() as cursor:
        if run.status != Run.SUCCEEDED:
            cursor.execute(st.end_stages, [stored(now), run.pk])
        if run.started_at is None:
            cursor.execute(st.first_start, [run.pk])
            first = cursor.fetchone()[0]
            run.started_at = db.to_datetime(first) if first is not None else None
            if run.started_at is not None:
                cursor.execute(st.run_started, [stored(run.started_at), run.pk])


def after_commit(using: str, signal: Any, **kwargs: Any) -> None:
    """Send `signal` once the step has committed (never for a step rolled back)."""

    def send() -> None:
        try:
            signal.send_robust(Run, **kwargs)
        except Exception:  # noqa: BLE001 - a receiver must not undo a committed step
            log.exception("a receiver of %s failed", signal)

    transaction.on_commit(send, using=using)
