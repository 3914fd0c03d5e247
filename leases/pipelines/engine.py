"""The pipeline engine: the state machine of runs, stages and tasks, on the job queue.

Each task is an ordinary job of its handler (so retries, backoff, timeouts, queues and
priorities are the handler's), marked with `backend = BACKEND` so the worker builds the
handler's payload when it runs, and with `on_finish = EVENT`: when the job ends for good
(succeeded, failed, dead, cancelled, discarded), the statement that records it also
queues an EVENT job in the same transaction. That job records the task's outcome and
advances the run. The other events (start, cancel, pause, resume, restart) are calls
that run as one transaction each, so an error reaches their caller and leaves nothing.

Every step locks the run's row first, so the steps of one run never interleave, and each
transition is a conditional UPDATE whose row count decides (a task leaves "queued" once,
a stage leaves "running" once): the join of many tasks finishing at the same instant in
different processes advances the run exactly once. A crash anywhere rolls the step back
and the queue runs the event again; a step whose reply was lost finds its work done.
"""
from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Callable, Iterator, TypeVar

from django.db import IntegrityError, transaction
from django.db.models import F

from leases import db
from leases.exceptions import Fail
from leases.sql import statements
from leases.tasks import queue as jobqueue
from leases.tasks import registry
from leases.tasks.models import Job, JobError
from leases.validation import check_name, dump_json

from . import signals
from .definition import CONTINUE, Pipeline, Stage, downstream, from_snapshot, upstream
from .models import KEY_LENGTH, Run, StageRun, TaskRun

log = logging.getLogger("leases.pipelines")

#: `Job.backend` of a pipeline task's job: the worker runs it through `task_runner`.
BACKEND = "leases.pipelines"
#: The handler of the event a task's job queues when it ends for good.
EVENT = "leases.pipelines.task_finished"
#: Task jobs pushed per INSERT, and ids per IN list.
CHUNK = 500

T = TypeVar("T")


# -- starting ---------------------------------------------------------------------------


def _live_key(pipeline: str, key: str) -> str:
    return hashlib.sha256(f"{pipeline}\n{key}".encode()).hexdigest()


def start(pipeline: Pipeline, context: Any = None, key: str | None = None, using: str | None = None) -> Run:
    """Start a run of `pipeline` and its first stages; with `key`, return the live run of
    (pipeline, key) instead when there is one (`run.created` says which).

    Everything is checked before anything is written: every task names a registered
    handler, the context is JSON the database can carry, the key is a printable name.
    """
    using = db.alias(using)
    for stage in pipeline.stages:
        for task in stage.tasks:
            jobqueue.queue_settings(registry.get(task).queue, using)  # UnknownHandler, unknown queue
    context = {} if context is None else context
    dump_json(context, "context")
    if key is not None:
        check_name(key, "key", KEY_LENGTH)
    snapshot = pipeline.snapshot()
    live = _live_key(pipeline.name, key if key is not None else f"#{uuid.uuid4().hex}")

    def work(cursor: Any, resumed: bool) -> tuple[Run, bool]:
        with db.write_transaction(using):
            existing = Run.objects.using(using).select_for_update().filter(live_key=live).first()
            if existing is not None:
                return existing, False
            now = _now(cursor)
            run = Run(
                pipeline=pipeline.name, key=key or "", live_key=live, status=Run.RUNNING,
                definition=snapshot, context=context, queued_at=now,
            )
            try:
                with transaction.atomic(using=using):
                    run.save(using=using)
            except IntegrityError:  # a racing start of the same key committed first
                return Run.objects.using(using).select_for_update().get(live_key=live), False
            StageRun.objects.using(using).bulk_create(
                StageRun(run=run, name=stage.name, position=index) for index, stage in enumerate(pipeline.stages)
            )
            _advance(run, now, using)
            return run, True

    run, created = db.run(work, using)
    run.created = created
    if created:
        log.info("pipeline %s run #%d started%s", run.pipeline, run.pk, f" (key {key})" if key else "")
    return run


# -- the state machine ------------------------------------------------------------------


def _now(cursor: Any) -> datetime:
    cursor.execute(statements(cursor.db).now, ())
    return db.to_datetime(cursor.fetchone()[0])


def _locked(run_id: int, using: str) -> Run | None:
    return Run.objects.using(using).select_for_update().filter(pk=run_id).first()


def _definition(run: Run) -> tuple[dict[str, Stage], dict[str, tuple[str, ...]]]:
    pipeline = from_snapshot(run.definition)
    return {stage.name: stage for stage in pipeline.stages}, pipeline.requires()


def _stages(run: Run, using: str) -> dict[str, StageRun]:
    return {stage.name: stage for stage in StageRun.objects.using(using).filter(run=run)}


def _usable(stage: StageRun, spec: Stage) -> bool:
    """Whether stages that require `stage` may start: it succeeded, or failed and its
    definition says to go on."""
    return stage.status == StageRun.SUCCEEDED or (stage.status == StageRun.FAILED and spec.on_failure == CONTINUE)


def _advance(run: Run, now: datetime, using: str) -> None:
    """Do everything the run's state allows: top up running stages, finish those whose
    tasks all finished, start stages whose requirements are met, finish the run."""
    if run.status != Run.RUNNING:
        return
    specs, requires = _definition(run)
    stages = _stages(run, using)
    moved = True
    while moved and run.status == Run.RUNNING:
        moved = False
        for name, stage in stages.items():
            if run.status != Run.RUNNING:
                return
            spec = specs[name]
            if stage.status == StageRun.WAITING and all(_usable(stages[need], specs[need]) for need in requires[name]):
                _start_stage(run, stage, spec, now, using)  # queues its first tasks
                moved = True
                if stage.status == StageRun.RUNNING and stage.pending == 0:
                    _finish_stage(run, stage, spec, now, using)
            elif stage.status == StageRun.RUNNING:
                if stage.pending == 0:
                    _finish_stage(run, stage, spec, now, using)
                    moved = True
                else:
                    _top_up(run, stage, spec, now, using)
    if run.status == Run.RUNNING and all(
        stage.status in (StageRun.SUCCEEDED, StageRun.FAILED) for stage in stages.values()
    ):
        _end_run(run, Run.SUCCEEDED, "", now, using)


def _start_stage(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    """Make the stage's tasks (one per item for a for_each) and queue the first of them."""
    items: list | None = None
    if spec.for_each is not None:
        value = _result(run, spec.for_each, using)
        if not isinstance(value, list):
            stage.status = StageRun.RUNNING
            StageRun.objects.using(using).filter(pk=stage.pk).update(status=StageRun.RUNNING, queued_at=now)
            kind = "null" if value is None else type(value).__name__
            _stage_failed(run, stage, spec, f"for_each task {spec.for_each!r} returned {kind}, not a list", now, using)
            return
        items = value
    if items is None:
        rows = [TaskRun(run=run, stage=stage, task=task, position=index) for index, task in enumerate(spec.tasks)]
    else:
        width = len(spec.tasks)
        rows = [
            TaskRun(run=run, stage=stage, task=task, position=number * width + index, item_index=number, item=item)
            for number, item in enumerate(items)
            for index, task in enumerate(spec.tasks)
        ]
    TaskRun.objects.using(using).bulk_create(rows, batch_size=CHUNK)
    changed = StageRun.objects.using(using).filter(pk=stage.pk, status=StageRun.WAITING).update(
        status=StageRun.RUNNING, total=len(rows), pending=len(rows), queued_at=now,
    )
    if changed != 1:  # cannot happen under the run's lock; refuse rather than start twice
        raise RuntimeError(f"stage {stage.name!r} of run #{run.pk} was started by someone else")
    Run.objects.using(using).filter(pk=run.pk).update(tasks_total=F("tasks_total") + len(rows))
    stage.status, stage.total, stage.pending, stage.queued_at = StageRun.RUNNING, len(rows), len(rows), now
    if rows:
        _top_up(run, stage, spec, now, using)


def _top_up(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    """Queue the stage's next waiting tasks, in order, up to its limit."""
    tasks = TaskRun.objects.using(using).filter(stage=stage)
    limit = spec.limit
    if limit is not None:
        limit -= tasks.filter(status=TaskRun.QUEUED).count()
        if limit <= 0:
            return
    waiting = tasks.filter(status=TaskRun.WAITING).order_by("position")
    chosen = list(waiting[:limit] if limit is not None else waiting)
    for start in range(0, len(chosen), CHUNK):
        _queue(run, stage, chosen[start : start + CHUNK], now, using)


def _queue(run: Run, stage: StageRun, tasks: list[TaskRun], now: datetime, using: str) -> None:
    """Push the jobs of `tasks` and mark them queued, in the caller's transaction."""
    new = []
    for task in tasks:
        spec = registry.get(task.task)
        payload = json.dumps({"run": run.pk, "stage": stage.name, "task": task.pk}, sort_keys=True)
        new.append(jobqueue.NewJob(
            queue=spec.queue, name=task.task, payload=payload, key=f"pipeline:{run.pk}:{task.pk}", priority=0,
            max_attempts=spec.max_attempts, backend=BACKEND, on_finish=EVENT,
        ))
    jobqueue.insert(new, using)
    ids = dict(
        Job.objects.using(using).filter(pending_key__in=[job.key for job in new]).values_list("pending_key", "id")
    )
    for task, job in zip(tasks, new):
        task.status, task.job_id, task.queued_at = TaskRun.QUEUED, ids[job.key], now
    TaskRun.objects.using(using).bulk_update(tasks, ["status", "job_id", "queued_at"], batch_size=CHUNK)


def _finish_stage(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    status = StageRun.FAILED if stage.failed_tasks else StageRun.SUCCEEDED
    started = _first_start(TaskRun.objects.using(using).filter(stage=stage))
    if StageRun.objects.using(using).filter(pk=stage.pk, status=StageRun.RUNNING).update(
        status=status, finished_at=now, started_at=started,
    ) == 1:
        stage.status, stage.finished_at, stage.started_at = status, now, started
        log.info("pipeline %s run #%d: stage %s %s (%d task(s))", run.pipeline, run.pk, stage.name, status, stage.total)
        _after_commit(using, signals.stage_finished, run=run, stage=stage)


def _first_start(tasks: Any) -> datetime | None:
    return tasks.exclude(started_at=None).order_by("started_at").values_list("started_at", flat=True).first()


def _stage_failed(run: Run, stage: StageRun, spec: Stage, error: str, now: datetime, using: str) -> None:
    """A task of `stage` failed for good (or its for_each had no list). With
    on_failure="continue" the stage goes on and fails when its tasks have finished;
    otherwise it fails now, and with it the run."""
    if spec.on_failure == CONTINUE:
        # A failed task was counted by its event; a stage whose for_each had no list has
        # no tasks, and counts itself.
        extra = 0 if stage.total else 1
        StageRun.objects.using(using).filter(pk=stage.pk).update(
            failed_tasks=F("failed_tasks") + extra, error=error[:10000],
        )
        stage.failed_tasks += extra
        stage.error = error
        return
    started = _first_start(TaskRun.objects.using(using).filter(stage=stage))
    if StageRun.objects.using(using).filter(pk=stage.pk, status=StageRun.RUNNING).update(
        status=StageRun.FAILED, error=error[:10000], finished_at=now, started_at=started,
    ) == 1:
        stage.status, stage.error, stage.finished_at = StageRun.FAILED, error, now
        _after_commit(using, signals.stage_finished, run=run, stage=stage)
    _end_run(run, Run.FAILED, f"stage {stage.name!r} failed: {error}", now, using)


def _end_run(run: Run, status: str, error: str, now: datetime, using: str) -> bool:
    """Finish a live run: nothing new starts, waiting jobs are cancelled (their tasks are
    recorded as cancelled by the events that follows), running tasks finish unheeded."""
    fields: dict[str, Any] = {"status": status, "error": error[:10000], "finished_at": now}
    if run.key:
        fields["live_key"] = None  # a new run of the key may start
    if Run.objects.using(using).filter(pk=run.pk, status__in=Run.LIVE).update(**fields) != 1:
        return False
    for name, value in fields.items():
        setattr(run, name, value)
    tasks = TaskRun.objects.using(using).filter(run=run)
    tasks.filter(status=TaskRun.WAITING).update(
        status=TaskRun.CANCELLED if status == Run.CANCELLED else TaskRun.SKIPPED, finished_at=now,
    )
    queued = list(tasks.filter(status=TaskRun.QUEUED).values_list("job_id", flat=True))
    for start in range(0, len(queued), CHUNK):
        jobqueue.cancel(queued[start : start + CHUNK], using)
    StageRun.objects.using(using).filter(run=run, status__in=(StageRun.WAITING, StageRun.RUNNING)).update(
        status=StageRun.CANCELLED, finished_at=now,
    )
    run.started_at = run.started_at or _first_start(tasks)
    Run.objects.using(using).filter(pk=run.pk).update(started_at=run.started_at)
    log.log(
        logging.INFO if status == Run.SUCCEEDED else logging.WARNING,
        "pipeline %s run #%d %s%s", run.pipeline, run.pk, status, f": {error}" if error else "",
    )
    _after_commit(using, signals.pipeline_finished, run=run)
    return True


def _after_commit(using: str, signal: Any, **kwargs: Any) -> None:
    """Send `signal` once the step has committed (never for a step rolled back)."""

    def send() -> None:
        try:
            signal.send_robust(Run, **kwargs)
        except Exception:  # noqa: BLE001 - a receiver must not undo a committed step
            log.exception("a receiver of %s failed", signal)

    transaction.on_commit(send, using=using)


# -- the task-finished event ------------------------------------------------------------


def task_finished(job_id: int, using: str | None = None) -> None:
    """Record how the job of a task ended and advance its run (the EVENT handler).

    Idempotent: a task leaves "queued" once, so a second delivery changes nothing. A
    job that runs again (an operator's retry) is left alone until it ends again.
    """
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> None:
        with db.write_transaction(using):
            found = TaskRun.objects.using(using).filter(job_id=job_id).values_list("run_id", flat=True).first()
            if found is None:
                return  # the stage was restarted since, or the run deleted
            run = _locked(found, using)
            task = TaskRun.objects.using(using).filter(job_id=job_id, status=TaskRun.QUEUED).first()
            if run is None or task is None:
                return
            if _record(run, task, _now(cursor), using):
                _advance(run, _now(cursor), using)

    db.run(work, using)


def _record(run: Run, task: TaskRun, now: datetime, using: str) -> bool:
    """Record the outcome of a queued task whose job has ended, under the run's lock;
    True when it was recorded (False: its job still waits or runs)."""
    outcome = _outcome(task.job_id, using)
    if outcome is None:
        return False
    status, result, error, attempts, started, finished = outcome
    if TaskRun.objects.using(using).filter(pk=task.pk, status=TaskRun.QUEUED).update(
        status=status, result=result, error=error, attempts=attempts, started_at=started, finished_at=finished or now,
    ) != 1:
        return False
    task.status, task.result, task.error = status, result, error
    task.attempts, task.started_at, task.finished_at = attempts, started, finished or now
    Run.objects.using(using).filter(pk=run.pk).update(tasks_done=F("tasks_done") + 1)
    stage = StageRun.objects.using(using).get(pk=task.stage_id)
    _after_commit(using, signals.task_finished, run=run, stage=stage, task=task)
    if stage.status != StageRun.RUNNING or run.status not in Run.LIVE:
        return True  # a late outcome of a stopped stage or run: recorded, moves nothing
    ok = status == TaskRun.SUCCEEDED
    StageRun.objects.using(using).filter(pk=stage.pk).update(
        pending=F("pending") - 1, failed_tasks=F("failed_tasks") + (0 if ok else 1),
    )
    stage.pending -= 1
    stage.failed_tasks += 0 if ok else 1
    if not ok:
        specs, _ = _definition(run)
        label = str(task) if task.item_index is None else f"{task.task} (item {task.item_index})"
        _stage_failed(run, stage, specs[stage.name], f"task {label} {status}: {error}", now, using)
    return True


def _outcome(job_id: int, using: str) -> tuple | None:
    """(task status, result, error, attempts, started, finished) of a job that ended for
    good; None while it still waits or runs."""
    job = Job.objects.using(using).filter(pk=job_id).values(
        "status", "result", "attempt", "started_at", "finished_at",
    ).first()
    if job is None:
        return TaskRun.FAILED, None, f"its job #{job_id} was deleted", 0, None, None
    if job["status"] not in Job.FINISHED:
        return None
    times = (job["started_at"], job["finished_at"])
    if job["status"] == Job.SUCCEEDED:
        return (TaskRun.SUCCEEDED, job["result"], "", job["attempt"], *times)
    if job["status"] == Job.CANCELLED:
        return (TaskRun.CANCELLED, None, "its job was cancelled", job["attempt"], None, job["finished_at"])
    last = JobError.objects.using(using).filter(job_id=job_id).order_by("-attempt", "-id").first()
    error = f"{last.exception.rsplit('.', 1)[-1]}: {last.message}" if last else "failed"
    return (TaskRun.FAILED, None, error[:10000], job["attempt"], *times)


# -- operators' events ------------------------------------------------------------------


def _step(run: Run, using: str | None, step: Callable[[Run, datetime, str], T]) -> T:
    """Run `step(locked run, now, alias)` as one transaction; refresh `run` after."""
    using = db.alias(using or run._state.db)

    def work(cursor: Any, resumed: bool) -> T:
        with db.write_transaction(using):
            locked = _locked(run.pk, using)
            if locked is None:
                raise ValueError(f"pipeline run #{run.pk} does not exist")
            return step(locked, _now(cursor), using)

    value = db.run(work, using)
    run.refresh_from_db(using=using)
    return value


def cancel(run: Run, using: str | None = None) -> bool:
    """Stop a live run: nothing new starts, waiting task jobs are cancelled, and what
    running handlers return later moves nothing. False if the run had already ended."""
    return _step(run, using, lambda locked, now, alias: _end_run(locked, Run.CANCELLED, "cancelled", now, alias))


def pause(run: Run, using: str | None = None) -> bool:
    """Start nothing new until resume(); queued and running tasks go on. False if it
    was paused already; ValueError for a run that has ended."""

    def step(locked: Run, now: datetime, alias: str) -> bool:
        _require_live(locked, "pause")
        return Run.objects.using(alias).filter(pk=locked.pk, status=Run.RUNNING).update(status=Run.PAUSED) == 1

    return _step(run, using, step)


def resume(run: Run, using: str | None = None) -> bool:
    """Let a paused run go on, starting what became due meanwhile. False if it was
    running already; ValueError for a run that has ended.

    It also repairs: a queued task whose job ended without its event being handled (an
    operator cancelled or deleted the event job) is recorded now, so `resume` on a run
    that looks stuck moves it on."""

    def step(locked: Run, now: datetime, alias: str) -> bool:
        _require_live(locked, "resume")
        resumed = Run.objects.using(alias).filter(pk=locked.pk, status=Run.PAUSED).update(status=Run.RUNNING) == 1
        locked.status = Run.RUNNING
        for task in TaskRun.objects.using(alias).filter(run=locked, status=TaskRun.QUEUED):
            if _record(locked, task, now, alias):
                log.warning("pipeline %s run #%d: recorded %s, whose job had ended unheeded",
                            locked.pipeline, locked.pk, task)
        _advance(locked, now, alias)
        return resumed

    return _step(run, using, step)


def _require_live(run: Run, action: str) -> None:
    if run.status not in Run.LIVE:
        raise ValueError(f"cannot {action} pipeline run #{run.pk}: it has {run.status}")


def restart(run: Run, stage: str, using: str | None = None) -> None:
    """Run a failed or cancelled stage again, then every stage that depends on it (and,
    in a cancelled or failed run, the stages its end cancelled); results of the others
    stay. The run is live again."""

    def step(locked: Run, now: datetime, alias: str) -> None:
        if locked.status == Run.SUCCEEDED:
            raise ValueError(f"pipeline run #{locked.pk} succeeded: there is nothing to restart")
        stages = _stages(locked, alias)
        if stage not in stages:
            raise ValueError(f"pipeline run #{locked.pk} has no stage {stage!r} (stages: {', '.join(stages)})")
        if stages[stage].status not in (StageRun.FAILED, StageRun.CANCELLED):
            raise ValueError(
                f"stage {stage!r} of run #{locked.pk} is {stages[stage].status}: only a failed or cancelled"
                " stage can be restarted"
            )
        _, requires = _definition(locked)
        reset = {stage} | {name for name, row in stages.items() if row.status == StageRun.CANCELLED}
        for name in list(reset):
            reset |= downstream(name, requires)
        busy = [name for name in reset if stages[name].status == StageRun.RUNNING]
        if busy:
            raise ValueError(f"stage {busy[0]!r} of run #{locked.pk} depends on {stage!r} and is still running")
        ids = [stages[name].pk for name in reset]
        tasks = TaskRun.objects.using(alias).filter(stage_id__in=ids)
        queued = list(tasks.filter(status=TaskRun.QUEUED).values_list("job_id", flat=True))
        for start in range(0, len(queued), CHUNK):
            jobqueue.cancel(queued[start : start + CHUNK], alias)
        tasks.delete()
        StageRun.objects.using(alias).filter(pk__in=ids).update(
            status=StageRun.WAITING, total=0, pending=0, failed_tasks=0, error="", queued_at=None,
            started_at=None, finished_at=None, restarts=F("restarts") + 1,
        )
        fields: dict[str, Any] = {"status": Run.RUNNING, "error": "", "finished_at": None}
        if locked.key:
            fields["live_key"] = _live_key(locked.pipeline, locked.key)
        fields["tasks_total"] = TaskRun.objects.using(alias).filter(run=locked).count()
        fields["tasks_done"] = TaskRun.objects.using(alias).filter(run=locked, status__in=TaskRun.FINISHED).count()
        try:
            with transaction.atomic(using=alias):
                Run.objects.using(alias).filter(pk=locked.pk).update(**fields)
        except IntegrityError:
            other = Run.objects.using(alias).filter(live_key=fields["live_key"]).values_list("pk", flat=True).first()
            raise ValueError(
                f"cannot restart run #{locked.pk}: run #{other} of key {locked.key!r} is live"
            ) from None
        for name, value in fields.items():
            setattr(locked, name, value)
        log.info("pipeline %s run #%d: restarting stage %s (%d stage(s) reset)", locked.pipeline, locked.pk,
                 stage, len(reset))
        _advance(locked, now, alias)

    _step(run, using, step)


# -- running a task ---------------------------------------------------------------------


class Results(Mapping):
    """The results of the tasks a stage depends on, read from the database on first use
    (a for_each stage's task: the list of its results in item order)."""

    def __init__(self, run: Run, tasks: list[str], using: str) -> None:
        self._run, self._tasks, self._using = run, tasks, using
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, task: str) -> Any:
        if task not in self._tasks:
            raise KeyError(task)
        if task not in self._loaded:
            self._loaded[task] = _result(self._run, task, self._using)
        return self._loaded[task]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __repr__(self) -> str:
        return f"Results({self._tasks})"


def _result(run: Run, task: str, using: str) -> Any:
    """A task's result: one value, or for a for_each stage's task a list in item order
    (None for an item that did not succeed)."""
    specs, _ = _definition(run)
    many = any(spec.for_each is not None and task in spec.tasks for spec in specs.values())
    rows = TaskRun.objects.using(using).filter(run=run, task=task).order_by("position").values_list("status", "result")
    if many:
        return [result if status == TaskRun.SUCCEEDED else None for status, result in rows]
    found = rows.first()
    return found[1] if found and found[0] == TaskRun.SUCCEEDED else None


def task_payload(stored: dict[str, Any], using: str | None = None) -> dict[str, Any]:
    """What a task's handler receives: the run's context, the results of every task of
    the stages it depends on, its item (in a for_each stage), the run's id and its stage.

    Fail when the task is no longer wanted (its run ended, its stage was restarted).
    """
    using = db.alias(using)
    task = TaskRun.objects.using(using).filter(pk=stored["task"]).first()
    run = Run.objects.using(using).filter(pk=stored["run"]).first()
    if task is None or run is None or task.status != TaskRun.QUEUED:
        raise Fail(f"task #{stored['task']} of pipeline run #{stored['run']} is no longer wanted")
    if run.status not in Run.LIVE:
        raise Fail(f"pipeline run #{run.pk} has {run.status}")
    specs, requires = _definition(run)
    names = [t for name in specs if name in upstream(stored["stage"], requires) for t in specs[name].tasks]
    payload = {"context": run.context, "results": Results(run, names, using), "run": run.pk, "stage": stored["stage"]}
    if specs[stored["stage"]].for_each is not None:
        payload["item"] = task.item
    return payload


class PipelineTask:
    """Runs a pipeline task's job for the worker: its handler's function, with the
    payload built when it runs; the handler's timeout and backoff apply."""

    def __init__(self, spec: registry.Handler) -> None:
        self.spec = spec
        self.timeout = spec.timeout

    def delay(self, attempt: int) -> float:
        return self.spec.delay(attempt)

    def run(self, job: Any) -> Any:
        return self.spec.func(task_payload(job.payload))


def task_runner(job: Any) -> PipelineTask:
    """The worker's entry point for a job whose `backend` is BACKEND."""
    return PipelineTask(registry.get(job.name))


def cancelled(payload: dict[str, Any], using: str | None = None) -> bool:
    """Whether the run of this task's payload was cancelled (a long handler asks now and
    then, and stops early)."""
    status = Run.objects.using(db.alias(using)).filter(pk=payload["run"]).values_list("status", flat=True).first()
    return status in (None, Run.CANCELLED)
