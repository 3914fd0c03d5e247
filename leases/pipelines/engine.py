"""The pipeline engine: the state machine of runs, stages and tasks, on the job queue.

Each task is an ordinary job of its handler (so retries, backoff, timeouts, queues and
priorities are the handler's), marked with `backend = BACKEND` so the worker builds the
handler's payload when it runs, and with `on_finish = TASK_ENDED`: the transaction that
ends the job for good (succeeded, failed, dead, cancelled, discarded) also records the
task's outcome and moves its stage's counters (`tasks_ended`), so a task's end cannot be
lost between the job and the pipeline. When a stage's last task is in, a task failed,
or a slot of a stage with waiting tasks came free, that transaction also queues the
run's advance event (EVENT, one waiting per run), which starts what comes next.

Every step that moves a run (the advance event, start, cancel, pause, resume, restart)
is one transaction that locks the run's row first, so those steps never interleave; each
transition is a conditional UPDATE whose row count decides (a task leaves "queued" once,
a stage leaves "running" once). However many tasks finish at the same instant in
different processes, the one that brings `pending` to zero queues the event, and the
run advances once. A crash anywhere rolls its transaction back: the job's outcome and
the task's record commit together or not at all, and the queue runs the event again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Callable, Iterator, TypeVar

from django.db import IntegrityError, connections, models, transaction
from django.db.models import F, Min, Subquery

from leases import db, routing
from leases.exceptions import Fail
from leases.sql import in_list, statements, update_each
from leases.tasks import queue as jobqueue
from leases.tasks import registry
from leases.tasks.models import PRIORITY_RANGE, Job, JobError
from leases.validation import check_name, dump_json

from . import signals
from . import sql as _sql  # noqa: F401 - registers the "pipeline" statements
from .definition import CONTINUE, Pipeline, Stage, downstream, from_snapshot, upstream
from .models import KEY_LENGTH, Run, StageRun, TaskRun

log = logging.getLogger("leases.pipelines")

#: `Job.backend` of a pipeline task's job: the worker runs it through `task_runner`.
BACKEND = "leases.pipelines"
#: The on_finish of a task's job: its end is recorded by `tasks_ended`, in the same transaction.
TASK_ENDED = "leases.pipelines.task_ended"
#: The handler of the event that advances a run (leases.pipelines.handlers).
EVENT = "leases.pipelines.advance"
#: Attempts of an advance event: it must not be lost, and it is idempotent.
EVENT_ATTEMPTS = 1000
#: Task jobs pushed per INSERT, and ids per IN list.
CHUNK = 500

T = TypeVar("T")
M = TypeVar("M", bound=models.Model)


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
            queue = registry.get(task).queue  # UnknownHandler
            routing.check_queue_on(queue, using, f"pipeline {pipeline.name}, task {task}")
            jobqueue.queue_settings(queue, using)  # unknown queue
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


def _load(model: type[M], using: str, tail: str, params: list, leave_out: tuple[str, ...] = ()) -> list[M]:
    """Instances of `model` from "SELECT <its columns> " + `tail`, as the ORM would make
    them (datetimes aware, `leave_out` deferred), without building a query."""
    connection = connections[using]
    fields = [f for f in model._meta.concrete_fields if f.attname not in leave_out]
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(quote(f.column) for f in fields) + " " + tail, params)
        rows = cursor.fetchall()
    names = [f.attname for f in fields]
    times = [i for i, f in enumerate(fields) if isinstance(f, models.DateTimeField)]
    found = []
    for row in rows:
        values = list(row)
        for i in times:
            if values[i] is not None:
                values[i] = db.to_datetime(values[i])
        found.append(model.from_db(using, names, values))
    return found


def _locked(run_id: int, using: str) -> Run | None:
    """The run's row, locked by writing it (its revision): on Galera a row lock binds its
    own node only, and two nodes' events about one run are refused at COMMIT, all but one,
    only if they wrote a row in common. Its definition comes from the cache, its context
    unread."""
    connection = connections[using]
    st = statements(connection, "pipeline")
    with connection.cursor() as cursor:
        cursor.execute(st.lock_run, [run_id])
        if cursor.rowcount != 1:
            return None
    table = connection.ops.quote_name(Run._meta.db_table)
    found = _load(Run, using, f"FROM {table} WHERE id = %s", [run_id], leave_out=("definition", "context"))
    return found[0] if found else None


Definition = tuple[dict[str, Stage], dict[str, tuple[str, ...]]]
#: Parsed definitions of the runs this process worked on, least recently used first. A
#: run's definition never changes; (alias, id, queued_at) names a run even in a database
#: whose ids start over.
_DEFINITIONS: OrderedDict[tuple[str, int, datetime], Definition] = OrderedDict()
DEFINITIONS_KEPT = 1000
_definitions_lock = threading.Lock()


def _definition_of(run_id: int, queued_at: Any, using: str, raw: Any = None) -> Definition:
    """Run `run_id`'s stages by name and their requirements, parsed once per process."""
    key = (using, run_id, db.to_datetime(queued_at))
    with _definitions_lock:
        found = _DEFINITIONS.get(key)
        if found is not None:
            _DEFINITIONS.move_to_end(key)
            return found
    if raw is None:
        connection = connections[using]
        with connection.cursor() as cursor:
            cursor.execute(statements(connection, "pipeline").definition, [run_id])
            raw = cursor.fetchone()[0]
    pipeline = from_snapshot(json.loads(raw) if isinstance(raw, (str, bytes)) else raw)
    parsed = {stage.name: stage for stage in pipeline.stages}, pipeline.requires()
    with _definitions_lock:
        _DEFINITIONS[key] = parsed
        while len(_DEFINITIONS) > DEFINITIONS_KEPT:
            _DEFINITIONS.popitem(last=False)
    return parsed


def _definition(run: Run) -> Definition:
    return _definition_of(run.pk, run.queued_at, run._state.db, run.__dict__.get("definition"))


def _stages(run: Run, using: str) -> dict[str, StageRun]:
    """The run's stages by name, in definition order."""
    tail = statements(connections[using], "pipeline").run_stages
    return {stage.name: stage for stage in _load(StageRun, using, tail, [run.pk])}


def _usable(stage: StageRun, spec: Stage) -> bool:
    """Whether stages that require `stage` may start: it succeeded, or failed and its
    definition says to go on."""
    return stage.status == StageRun.SUCCEEDED or (stage.status == StageRun.FAILED and spec.on_failure == CONTINUE)


def _advance(run: Run, now: datetime, using: str) -> None:
    """Do everything the run's state allows, under the run's lock: fail the run on a
    stage's failed task, finish stages whose tasks all finished, top up stages that queue
    their tasks a few at a time, start stages whose requirements are met, end the run."""
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
        _end_run(run, Run.SUCCEEDED, "", now, using)


def _start_stage(run: Run, stage: StageRun, spec: Stage, now: datetime, using: str) -> None:
    """Make the stage's tasks (one per item for a for_each) and queue the first of them."""
    items: list | None = None
    if spec.for_each is not None:
        value = _result(run.pk, _definition(run)[0], spec.for_each, using)
        if not isinstance(value, list):
            StageRun.objects.using(using).filter(pk=stage.pk).update(status=StageRun.RUNNING, queued_at=now)
            stage.status, stage.queued_at = StageRun.RUNNING, now
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
    count = len(rows)
    first = rows[: count if spec.limit is None else spec.limit]
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(statements(connection, "pipeline").stage_started,
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
    st = statements(connection, "pipeline")
    with connection.cursor() as cursor:
        cursor.execute(st.next_waiting, [stage.pk, free])
        chosen = [TaskRun.from_db(using, ["id", "task"], row) for row in cursor.fetchall()]
    for start in range(0, len(chosen), CHUNK):
        _queue(run, stage, chosen[start : start + CHUNK], now, using)
    with connection.cursor() as cursor:
        cursor.execute(st.took_waiting, [len(chosen), stage.pk])
    stage.waiting -= len(chosen)


def _queue(run: Run, stage: StageRun, tasks: list[TaskRun], now: datetime, using: str) -> None:
    """Push the jobs of `tasks` and mark them queued, in the caller's transaction."""
    new = []
    for task in tasks:
        spec = registry.get(task.task)
        payload = json.dumps({"run": run.pk, "stage": stage.name, "task": task.pk}, sort_keys=True)
        new.append(jobqueue.NewJob(
            queue=spec.queue, name=task.task, payload=payload, key=f"pipeline:{run.pk}:{task.pk}", priority=0,
            max_attempts=spec.max_attempts, backend=BACKEND, on_finish=TASK_ENDED,
        ))
    connection = connections[using]
    keys = [job.key for job in new]
    with connection.cursor() as cursor:
        jobqueue.write(cursor, new)
        cursor.execute(statements(connection, "pipeline").jobs_by_key + in_list(keys), keys)
        ids = dict(cursor.fetchall())
    update_each(
        connection, db.table(TaskRun, connection), {task.pk: {"job_id": ids[job.key]} for task, job in zip(tasks, new)},
        fixed={"status": TaskRun.QUEUED, "queued_at": now},
    )


def _finish_stage(run: Run, stage: StageRun, now: datetime, using: str) -> None:
    """All the stage's tasks finished: it succeeded, or (on_failure="continue") failed
    saying why."""
    status = StageRun.FAILED if stage.failed_tasks else StageRun.SUCCEEDED
    error = (stage.error or _first_failure(stage, using)) if stage.failed_tasks else ""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(statements(connection, "pipeline").stage_ended, [
            status, db.dialect(connection).stored_datetime(now), error[:10000], stage.pk, stage.pk,
        ])
        ended = cursor.rowcount == 1
    if ended:
        stage.status, stage.finished_at, stage.error = status, now, error
        log.info("pipeline %s run #%d: stage %s %s (%d task(s))", run.pipeline, run.pk, stage.name, status, stage.total)
        _after_commit(using, signals.stage_finished, run=run, stage=stage)


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
    _end_run(run, Run.FAILED, f"stage {stage.name!r} failed: {error}", now, using, failed=(stage, error))


def _end_run(run: Run, status: str, error: str, now: datetime, using: str,
             failed: tuple[StageRun, str] | None = None) -> bool:
    """Finish a live run: nothing new starts, waiting jobs are cancelled (their tasks
    are recorded as cancelled in the same statement), running tasks finish unheeded.
    `failed` names the stage that failed it; the other unfinished stages are cancelled.

    Jobs are cancelled before stage rows are touched: a worker recording an outcome
    holds its job's row and then wants its stage's, so the reverse order could deadlock.
    """
    connection = connections[using]
    st, stored = statements(connection, "pipeline"), db.dialect(connection).stored_datetime(now)
    with connection.cursor() as cursor:
        # A keyed run frees its key: a new run of the key may start.
        cursor.execute(st.end_run, [status, error[:10000], stored, bool(run.key), run.pk])
        if cursor.rowcount != 1:
            return False
        run.status, run.error, run.finished_at = status, error[:10000], now
        if run.key:
            run.live_key = None
        skipped = TaskRun.CANCELLED if status == Run.CANCELLED else TaskRun.SKIPPED
        cursor.execute(st.end_waiting, [skipped, stored, run.pk])
        cursor.execute(st.queued_jobs, [run.pk])
        queued = [job_id for (job_id,) in cursor.fetchall()]
    for start in range(0, len(queued), CHUNK):
        jobqueue.cancel(queued[start : start + CHUNK], using)
    if failed is not None:
        stage, reason = failed
        open_stage = StageRun.objects.using(using).filter(pk=stage.pk, status__in=(StageRun.WAITING, StageRun.RUNNING))
        if open_stage.update(
            status=StageRun.FAILED, error=reason[:10000], finished_at=now, started_at=_first_start(stage),
        ) == 1:
            stage.status, stage.error, stage.finished_at = StageRun.FAILED, reason, now
            _after_commit(using, signals.stage_finished, run=run, stage=stage)
    with connection.cursor() as cursor:
        cursor.execute(st.end_stages, [stored, run.pk])
        if run.started_at is None:
            cursor.execute(st.first_start, [run.pk])
            first = cursor.fetchone()[0]
            run.started_at = db.to_datetime(first) if first is not None else None
            if run.started_at is not None:
                cursor.execute(st.run_started, [db.dialect(connection).stored_datetime(run.started_at), run.pk])
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


# -- a task's end, and the advance event ------------------------------------------------


def tasks_ended(cursor: Any, ended: list[tuple[int, str]]) -> None:
    """The finisher of task jobs (registry.add_finisher): record how each ended, in the
    transaction that ended it, and queue the advance event of each run that can move.

    Outcomes are recorded without the run's lock: a task leaves "queued" once, by a
    conditional UPDATE, and its stage's counters move in the same transaction. Whoever
    brings a stage's `pending` to zero, records a failure, or frees a slot of a stage
    with tasks still waiting queues the run's advance event (one waits per run: a
    second push merges into it), so the run moves once its outcomes are all in.
    """
    using = cursor.db.alias
    moving = _record([job_id for job_id, _ in ended], using, lambda: _now(cursor))
    if not moving:
        return
    queues = dict(ended)
    jobqueue.write(cursor, [
        jobqueue.NewJob(
            queue=queues[job_id], name=EVENT, payload=json.dumps({"run": run_id}), key=f"{EVENT}:{run_id}",
            priority=PRIORITY_RANGE[1], max_attempts=EVENT_ATTEMPTS,
        )
        for run_id, job_id in sorted(moving.items())
    ])


def _record(job_ids: list[int], using: str, clock: Callable[[], datetime]) -> dict[int, int]:
    """Record the outcomes of the queued tasks of these jobs that have ended (a job still
    waiting or running is left alone); returns {run id: a job id} for each run whose
    advance is due. A late outcome (its stage stopped) is recorded and moves nothing.

    Successes and cancellations, the usual endings, take one statement each for the
    whole batch; a failure reads its job's last error and is written alone.
    """
    connection = connections[using]
    st = statements(connection, "pipeline")
    with connection.cursor() as cursor:
        cursor.execute(st.ended + in_list(job_ids), job_ids)
        rows = sorted(cursor.fetchall())
        if not rows:
            return {}
        kinds: dict[str, list[int]] = {"succeeded": [], "cancelled": []}
        failed: list[tuple[int, int]] = []
        counts: dict[int, list[int]] = {}  # stage id -> [recorded, failed]
        runs: dict[int, tuple[int, int]] = {}  # stage id -> (run id, a job id)
        for task_id, run_id, stage_id, job_id, status in rows:
            if status == Job.SUCCEEDED:
                kinds["succeeded"].append(task_id)
            elif status == Job.CANCELLED:
                kinds["cancelled"].append(task_id)
            elif status is None or status in Job.FINISHED:
                failed.append((task_id, job_id))
            else:
                continue  # still waiting or running: its end records it
            count = counts.setdefault(stage_id, [0, 0])
            count[0] += 1
            count[1] += status != Job.SUCCEEDED
            runs[stage_id] = (run_id, job_id)
        if not counts:
            return {}
        for kind, ids in kinds.items():
            if ids:
                cursor.execute(getattr(st, kind) + in_list(ids), ids)
                if cursor.rowcount != len(ids):  # each job ends once; nothing else records these
                    log.error("pipelines: recorded %d of %d %s tasks %s", cursor.rowcount, len(ids), kind, ids)
        if failed:
            outcomes = _outcomes([job_id for _, job_id in failed], using, clock)
            for task_id, job_id in failed:
                status, result, error, attempts, started, finished = outcomes[job_id]
                TaskRun.objects.using(using).filter(pk=task_id, status=TaskRun.QUEUED).update(
                    status=status, result=result, error=error, attempts=attempts, started_at=started,
                    finished_at=finished,
                )
        for stage_id in sorted(counts):  # one order everywhere, so two recorders cannot deadlock
            done, bad = counts[stage_id]
            cursor.execute(st.count, [done, done, bad, stage_id])
        stage_ids = sorted(counts)
        cursor.execute(st.stages + in_list(stage_ids), stage_ids)
        moving: dict[int, int] = {}
        for stage_id, run_id, status, pending, waiting in cursor.fetchall():
            if status == StageRun.RUNNING and (pending == 0 or waiting or counts[stage_id][1]):
                moving[run_id] = runs[stage_id][1]
    if signals.task_finished.has_listeners(Run):
        _announce([task_id for task_id, *_ in rows], using)
    return moving


def _outcomes(job_ids: list[int], using: str, clock: Callable[[], datetime]) -> dict[int, tuple]:
    """{job id: (task status, result, error, attempts, started, finished)} of jobs that
    failed for good; a job deleted (discarded) counts as failed, ending at `clock()`."""
    found: dict[int, tuple] = {}
    jobs = Job.objects.using(using).filter(pk__in=job_ids).values_list("pk", "attempt", "started_at", "finished_at")
    for pk, attempt, started, finished in jobs:
        found[pk] = (TaskRun.FAILED, None, "failed", attempt, started, finished)
    errors = JobError.objects.using(using).filter(job_id__in=list(found)).order_by("job_id", "-attempt", "-id")
    for job_id, exception, message in errors.values_list("job_id", "exception", "message"):
        status, result, error, *rest = found[job_id]
        if error == "failed":  # the newest error of the job comes first
            found[job_id] = (status, result, f"{exception.rsplit('.', 1)[-1]}: {message}"[:10000], *rest)
    missing = set(job_ids) - set(found)
    if missing:
        now = clock()
        for job_id in missing:
            found[job_id] = (TaskRun.FAILED, None, f"its job #{job_id} was deleted", 0, None, now)
    return found


def _announce(task_ids: list[int], using: str) -> None:
    """Send task_finished for recorded tasks once their transaction commits."""
    tasks = list(TaskRun.objects.using(using).filter(pk__in=task_ids).select_related("run", "stage"))
    for task in tasks:
        _after_commit(using, signals.task_finished, run=task.run, stage=task.stage, task=task)


def advance(run_id: int, using: str | None = None) -> None:
    """The advance event: under the run's lock, do whatever its recorded outcomes allow.
    Idempotent, so a second delivery or a merged push changes nothing more."""
    using = db.alias(using)

    def work(cursor: Any, resumed: bool) -> None:
        with db.write_transaction(using):
            run = _locked(run_id, using)
            if run is not None:
                _advance(run, _now(cursor), using)

    db.run(work, using)


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

    It also repairs, so `resume` on a run that looks stuck moves it on: a queued task
    whose job ended unrecorded (its row edited by hand, or ended by a process without
    this app) is recorded now, and the advance event an operator cancelled or deleted
    is done here."""

    def step(locked: Run, now: datetime, alias: str) -> bool:
        _require_live(locked, "resume")
        resumed = Run.objects.using(alias).filter(pk=locked.pk, status=Run.PAUSED).update(status=Run.RUNNING) == 1
        locked.status = Run.RUNNING
        queued = TaskRun.objects.using(alias).filter(run=locked, status=TaskRun.QUEUED)
        jobs = list(queued.values_list("job_id", flat=True))
        for start in range(0, len(jobs), CHUNK):
            _record(jobs[start : start + CHUNK], alias, lambda: now)
        if (repaired := len(jobs) - queued.count()) > 0:
            log.warning("pipeline %s run #%d: recorded %d task(s) whose job had ended unrecorded",
                        locked.pipeline, locked.pk, repaired)
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
            status=StageRun.WAITING, total=0, pending=0, waiting=0, done=0, failed_tasks=0, error="", queued_at=None,
            started_at=None, finished_at=None, restarts=F("restarts") + 1,
        )
        fields: dict[str, Any] = {"status": Run.RUNNING, "error": "", "finished_at": None}
        if locked.key:
            fields["live_key"] = _live_key(locked.pipeline, locked.key)
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


# -- history --------------------------------------------------------------------------


def prune(older_than: float, batch_size: int = 100, using: str | None = None,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete runs that ended more than `older_than` seconds ago (by the database clock),
    with their stages and tasks; returns how many. Live runs are never touched.

    Each run goes in a transaction of its own that locks it and checks again that it has
    ended, so a restart at the same moment either wins (the run stays) or finds it gone.
    The jobs of its tasks are the queue's, pruned by `leases_prune`.
    """
    using = db.alias(using)

    def cutoff(cursor: Any, resumed: bool) -> datetime:
        return _now(cursor) - timedelta(seconds=older_than)

    before = db.run(cutoff, using)
    deleted = 0
    while True:
        ids = list(
            Run.objects.using(using).filter(finished_at__lt=before).order_by("finished_at")
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return deleted
        count = 0
        for run_id in ids:

            def work(cursor: Any, resumed: bool, run_id: int = run_id) -> int:
                with db.write_transaction(using):
                    run = _locked(run_id, using)
                    if run is None or run.status in Run.LIVE or not run.finished_at or run.finished_at >= before:
                        return 0
                    TaskRun.objects.using(using).filter(run_id=run_id).delete()
                    StageRun.objects.using(using).filter(run_id=run_id).delete()
                    Run.objects.using(using).filter(pk=run_id).delete()
                    return 1

            count += db.run(work, using)
        deleted += count
        if progress:
            progress(count)
        if count == 0:  # every run of the batch came back to life meanwhile
            return deleted


# -- running a task ---------------------------------------------------------------------


class Results(Mapping):
    """The results of the tasks a stage depends on, read from the database on first use
    (a for_each stage's task: the list of its results in item order)."""

    def __init__(self, run_id: int, specs: dict[str, Stage], tasks: list[str], using: str) -> None:
        self._run_id, self._specs, self._tasks, self._using = run_id, specs, tasks, using
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, task: str) -> Any:
        if task not in self._tasks:
            raise KeyError(task)
        if task not in self._loaded:
            self._loaded[task] = _result(self._run_id, self._specs, task, self._using)
        return self._loaded[task]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __repr__(self) -> str:
        return f"Results({self._tasks})"


def _result(run_id: int, specs: dict[str, Stage], task: str, using: str) -> Any:
    """A task's result: one value, or for a for_each stage's task a list in item order
    (None for an item that did not succeed)."""
    many = any(spec.for_each is not None and task in spec.tasks for spec in specs.values())
    rows = TaskRun.objects.using(using).filter(run_id=run_id, task=task).order_by("position")
    rows = rows.values_list("status", "result")
    if many:
        return [result if status == TaskRun.SUCCEEDED else None for status, result in rows]
    found = rows.first()
    return found[1] if found and found[0] == TaskRun.SUCCEEDED else None


def _json(value: Any) -> Any:
    """A JSON column as a raw cursor returns it (text, or NULL)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def task_payload(stored: dict[str, Any], using: str | None = None) -> dict[str, Any]:
    """What a task's handler receives: the run's context, the results of every task of
    the stages it depends on, its item (in a for_each stage), the run's id and its stage.
    One read: the definition is cached, the results are read when the handler asks.

    Fail when the task is no longer wanted (its run ended, its stage was restarted).
    """
    using = db.alias(using)
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(statements(connection, "pipeline").task, [stored["task"]])
        row = cursor.fetchone()
    run_id = stored["run"]
    if row is not None and row[2] not in Run.LIVE:
        raise Fail(f"pipeline run #{run_id} has {row[2]}")
    if row is None or row[0] != TaskRun.QUEUED:
        raise Fail(f"task #{stored['task']} of pipeline run #{run_id} is no longer wanted")
    _, item, _, context, queued_at = row
    specs, requires = _definition_of(run_id, queued_at, using)
    names = [t for name in specs if name in upstream(stored["stage"], requires) for t in specs[name].tasks]
    payload = {
        "context": _json(context), "results": Results(run_id, specs, names, using), "run": run_id,
        "stage": stored["stage"],
    }
    if specs[stored["stage"]].for_each is not None:
        payload["item"] = _json(item)
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
