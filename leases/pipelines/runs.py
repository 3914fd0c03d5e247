"""A run's life as callers and operators steer it: start, cancel, pause, resume, restart,
and prune when it has long ended. Each is one transaction that locks the run's row first
(`store.locked`), then lets the state machine (`machine`) do what the run now allows.
"""
from __future__ import annotations

import hashlib
import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any, Callable, TypeVar

from django.db import IntegrityError, transaction
from django.db.models import F

from leases import clock, db, routing
from leases.encoding import dump_json, load_json
from leases.tasks import registry, tracing
from leases.tasks.jobs.actions import cancel as cancel_jobs
from leases.tasks.jobs.payload import dump_payload
from leases.tasks.jobs.queues import queue_settings
from leases.validation import check_name, check_seconds

from . import machine, store
from .definition import Pipeline, downstream
from .models import KEY_LENGTH, NAME_LENGTH, Run, StageRun, TaskRun
from .outcomes import record

log = logging.getLogger("leases.pipelines")

T = TypeVar("T")
CHUNK = machine.CHUNK


def live_key(pipeline: str, key: str) -> str:
    """What makes "one live run per (pipeline, key)" a unique index."""
    return hashlib.sha256(f"{pipeline}\n{key}".encode()).hexdigest()


def _check_start(pipeline: Pipeline, context: Any, key: str | None, using: str) -> dict:
    """The run's context, everything checked before anything is written: every task names
    a registered handler on a queue a worker can serve, the context is JSON the database
    can carry, the key is a printable name."""
    for stage in pipeline.stages:
        for task in stage.tasks:
            queue = registry.get(task).queue  # UnknownHandler
            routing.check_queue_on(queue, using, f"pipeline {pipeline.name}, task {task}")
            queue_settings(queue, using)  # unknown queue
    context = {} if context is None else context
    dump_json(context, "context")
    if key is not None:
        check_name(key, "key", KEY_LENGTH)
    return context


def start(pipeline: Pipeline, context: Any = None, key: str | None = None, using: str | None = None) -> Run:
    """Start a run of `pipeline` and its first stages; with `key`, return the live run of
    (pipeline, key) instead when there is one (`run.created` says which). With tracing
    on, the start is the run's span, the parent of its tasks' (see leases.tasks.tracing)."""
    using = db.alias(using)
    context = _check_start(pipeline, context, key, using)
    with tracing.pipeline_started(pipeline.name, key) as traced:
        run, created = db.run(_starter(pipeline, context, key, traced.traceparent, using), using)
        traced.ran(run.pk, created)
    run.created = created
    if created:
        log.info("pipeline %s run #%d started%s", run.pipeline, run.pk, f" (key {key})" if key else "")
    return run


def _starter(pipeline: Pipeline, context: Any, key: str | None, traceparent: str | None,
             using: str) -> Callable[[Any, bool], tuple[Run, bool]]:
    """The transaction of a start: (the new run, True), or (the live run of the key, False)."""
    snapshot = pipeline.snapshot()
    live = live_key(pipeline.name, key if key is not None else f"#{uuid.uuid4().hex}")

    def work(cursor: Any, resumed: bool) -> tuple[Run, bool]:
        with db.write_transaction(using):
            existing = Run.objects.using(using).select_for_update().filter(live_key=live).first()
            if existing is not None:
                return existing, False
            now = clock.now(cursor)
            run = Run(
                pipeline=pipeline.name, key=key or "", live_key=live, status=Run.RUNNING,
                definition=snapshot, context=context, queued_at=now, traceparent=traceparent,
            )
            try:
                with transaction.atomic(using=using):
                    run.save(using=using)
            except IntegrityError:  # a racing start of the same key committed first
                return Run.objects.using(using).select_for_update().get(live_key=live), False
            StageRun.objects.using(using).bulk_create(
                StageRun(run=run, name=stage.name, position=index) for index, stage in enumerate(pipeline.stages)
            )
            machine.advance(run, now, using)
            return run, True

    return work


def _step(run: Run, using: str | None, step: Callable[[Run, datetime, str], T]) -> T:
    """Run `step(locked run, now, alias)` as one transaction; refresh `run` after."""
    using = db.alias(using or run._state.db)

    def work(cursor: Any, resumed: bool) -> T:
        with db.write_transaction(using):
            locked = store.locked(run.pk, using)
            if locked is None:
                raise ValueError(f"pipeline run #{run.pk} does not exist")
            return step(locked, clock.now(cursor), using)

    value = db.run(work, using)
    run.refresh_from_db(using=using)
    return value


def send_event(run: Run, name: str, data: Any = None, using: str | None = None) -> bool:
    """Record the run-level event `name` (JSON `data`) and advance the run, so a stage
    waiting for it starts now. False if the run had it already; ValueError for a run
    that has ended, a bad name or data that is not JSON."""
    name = check_name(name, "event name", NAME_LENGTH)
    text = dump_payload(data, "the event's data")

    def step(locked: Run, now: datetime, alias: str) -> bool:
        if locked.status not in Run.LIVE:
            raise ValueError(f"pipeline run #{locked.pk} has {locked.status}: the event {name!r} was not sent")
        events = machine._events(locked)
        if name in events:
            return False
        Run.objects.using(alias).filter(pk=locked.pk).update(events={**events, name: load_json(text)})
        locked.events = {**events, name: load_json(text)}
        machine.advance(locked, now, alias)
        return True

    return _step(run, using, step)


def wait(run: Run, timeout: float = 60.0, using: str | None = None) -> Run:
    """`run`, refreshed once it has ended, waiting up to `timeout` seconds (reading its
    status at growing intervals); TimeoutError if it is still live then."""
    using = db.alias(using or run._state.db)
    deadline, pause = time.monotonic() + check_seconds(timeout, "timeout"), 0.02
    while True:
        run.refresh_from_db(using=using, fields=["status", "error", "finished_at"])
        if run.status not in Run.LIVE:
            run.refresh_from_db(using=using)
            return run
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"pipeline run #{run.pk} is still {run.status} after {timeout:g}s")
        time.sleep(min(left, pause))
        pause = min(0.25, pause * 2)


def cancel(run: Run, using: str | None = None) -> bool:
    """Stop a live run: nothing new starts, waiting task jobs are cancelled, and what
    running handlers return later moves nothing. False if the run had already ended."""
    return _step(run, using, lambda locked, now, alias: machine.end_run(locked, Run.CANCELLED, "cancelled", now,
                                                                        alias))


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
            record(jobs[start : start + CHUNK], alias, lambda: now)
        if (repaired := len(jobs) - queued.count()) > 0:
            log.warning("pipeline %s run #%d: recorded %d task(s) whose job had ended unrecorded",
                        locked.pipeline, locked.pk, repaired)
        machine.advance(locked, now, alias)
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
        reset = _stages_to_reset(locked, stage, alias)
        _reset(locked, reset, alias)
        fields: dict[str, Any] = {"status": Run.RUNNING, "error": "", "finished_at": None}
        if locked.key:
            fields["live_key"] = live_key(locked.pipeline, locked.key)
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
        machine.advance(locked, now, alias)

    _step(run, using, step)


def _stages_to_reset(run: Run, stage: str, using: str) -> dict[str, StageRun]:
    """`stage` and every stage that depends on it, and those the run's end cancelled;
    ValueError when the run or the stage cannot be restarted."""
    if run.status == Run.SUCCEEDED:
        raise ValueError(f"pipeline run #{run.pk} succeeded: there is nothing to restart")
    stages = store.stages(run, using)
    if stage not in stages:
        raise ValueError(f"pipeline run #{run.pk} has no stage {stage!r} (stages: {', '.join(stages)})")
    if stages[stage].status not in (StageRun.FAILED, StageRun.CANCELLED):
        raise ValueError(
            f"stage {stage!r} of run #{run.pk} is {stages[stage].status}: only a failed or cancelled"
            " stage can be restarted"
        )
    _, requires = store.definition(run)
    reset = {stage} | {name for name, row in stages.items() if row.status == StageRun.CANCELLED}
    for name in list(reset):
        reset |= downstream(name, requires)
    busy = [name for name in reset if stages[name].status == StageRun.RUNNING]
    if busy:
        raise ValueError(f"stage {busy[0]!r} of run #{run.pk} depends on {stage!r} and is still running")
    return {name: stages[name] for name in reset}


def _reset(run: Run, reset: dict[str, StageRun], using: str) -> None:
    """The stages start over: their waiting jobs cancelled, their tasks gone."""
    ids = [row.pk for row in reset.values()]
    tasks = TaskRun.objects.using(using).filter(stage_id__in=ids)
    queued = list(tasks.filter(status=TaskRun.QUEUED).values_list("job_id", flat=True))
    for start in range(0, len(queued), CHUNK):
        cancel_jobs(queued[start : start + CHUNK], using)
    tasks.delete()
    StageRun.objects.using(using).filter(pk__in=ids).update(
        status=StageRun.WAITING, total=0, pending=0, waiting=0, done=0, failed_tasks=0, error="", queued_at=None,
        started_at=None, finished_at=None, restarts=F("restarts") + 1,
    )


def prune(older_than: float, batch_size: int = 100, using: str | None = None,
          progress: Callable[[int], None] | None = None) -> int:
    """Delete runs that ended more than `older_than` seconds ago (by the database clock),
    with their stages and tasks; returns how many. Live runs are never touched.

    Each run goes in a transaction of its own that locks it and checks again that it has
    ended, so a restart at the same moment either wins (the run stays) or finds it gone.
    The jobs of its tasks are the queue's, pruned by `leases_prune`.
    """
    using = db.alias(using)
    before = clock.db_now(using) - timedelta(seconds=older_than)
    deleted = 0
    while True:
        ids = list(
            Run.objects.using(using).filter(finished_at__lt=before).order_by("finished_at")
            .values_list("pk", flat=True)[:batch_size]
        )
        if not ids:
            return deleted
        count = sum(db.run(_pruner(run_id, before, using), using) for run_id in ids)
        deleted += count
        if progress:
            progress(count)
        if count == 0:  # every run of the batch came back to life meanwhile
            return deleted


def _pruner(run_id: int, before: datetime, using: str) -> Callable[[Any, bool], int]:
    def work(cursor: Any, resumed: bool) -> int:
        with db.write_transaction(using):
            run = store.locked(run_id, using)
            if run is None or run.status in Run.LIVE or not run.finished_at or run.finished_at >= before:
                return 0
            TaskRun.objects.using(using).filter(run_id=run_id).delete()
            StageRun.objects.using(using).filter(run_id=run_id).delete()
            Run.objects.using(using).filter(pk=run_id).delete()
            return 1

    return work
