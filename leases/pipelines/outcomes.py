"""A task's end: recorded in the transaction that ends its job for good (succeeded,
failed, dead, cancelled, discarded), by the finisher this app registers for its tasks'
jobs, so a task's end cannot be lost between the job and the pipeline.

Outcomes are recorded without the run's lock: a task leaves "queued" once, by a
conditional UPDATE, and its stage's counters move in the same transaction. Whoever brings
a stage's `pending` to zero, records a failure, or frees a slot of a stage with tasks
still waiting moves the run on: in the same transaction when the run's row and its
stages' rows can be locked without waiting (the usual case: a hand-over costs no job and
no transaction of its own), else by queueing the run's advance event (one waits per run:
a second push merges into it), which waits for the locks in a transaction of its own.
Never waiting there keeps a recorder, which holds its jobs' rows, out of any lock cycle
with a step that holds the run and wants those jobs (a cancel).
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Callable

from django.db import connections, transaction

from leases import clock, db
from leases.sql import in_list, update_each
from leases.tasks import tracing
from leases.tasks.jobs.outcomes import last_errors
from leases.tasks.jobs.push import new_job, write
from leases.tasks.models import PRIORITY_RANGE, Job

from . import signals, sql, store
from .machine import EVENT, advance, after_commit
from .models import Run, StageRun, TaskRun

log = logging.getLogger("leases.pipelines")


def tasks_ended(cursor: Any, ended: list[tuple[int, str]]) -> None:
    """The finisher of task jobs (`leases.tasks.registry.add_finisher`): record how each
    ended, in the transaction that ended it, and move on each run that can: there, or by
    its advance event, queued on the queue of one of its tasks (which a worker serves),
    ahead of work."""
    using = cursor.db.alias
    now = _Now(cursor)
    moving = record([job_id for job_id, _ in ended], using, now)
    if not moving:
        return
    for run_id in _advance_here(cursor, sorted(moving), now):
        del moving[run_id]
    if not moving:
        return
    queues = dict(ended)
    contexts = _contexts(cursor, sorted(moving)) if tracing.enabled() else {}
    write(cursor, [
        new_job(EVENT, {"run": run_id}, queue=queues[job_id], key=f"{EVENT}:{run_id}", priority=PRIORITY_RANGE[1],
                traceparent=contexts.get(run_id))
        for run_id, job_id in sorted(moving.items())
    ])


class _Now:
    """The database's clock, read once per transaction, when first needed."""

    def __init__(self, cursor: Any) -> None:
        self._cursor, self._value = cursor, None

    def __call__(self) -> datetime:
        if self._value is None:
            self._value = clock.now(self._cursor)
        return self._value


def _advance_here(cursor: Any, run_ids: list[int], now: Callable[[], datetime]) -> list[int]:
    """Move on, in this transaction, each of these runs whose row and stages' rows no one
    holds (locked without waiting, in id order, and read by the same statements); returns
    the runs moved. A run that another step holds is left to its advance event. A step
    that fails for another reason than a transient one is undone alone (a savepoint), and
    its event retries it."""
    connection = cursor.db
    using, st, skip = connection.alias, sql.pipeline(connection), " ORDER BY id" + db.skip_locked(connection)
    runs = store.load(Run, using, st.free_runs + in_list(run_ids) + skip, run_ids, leave_out=store.UNREAD)
    if not runs:
        return []
    held = [run.pk for run in runs]
    stages: dict[int, list[StageRun]] = {}
    for stage in store.load(StageRun, using, st.free_stages + in_list(held) + skip, held):
        stages.setdefault(stage.run_id, []).append(stage)
    moved = []
    for run in runs:
        specs, _ = store.definition(run)
        if len(stages.get(run.pk, ())) != len(specs):
            continue  # a stage of it is being written: its event will wait for it
        try:
            with transaction.atomic(using=using):
                cursor.execute(st.lock_run, [run.pk])  # for Galera, which certifies writes only
                advance(run, now(), using, {s.name: s for s in sorted(stages[run.pk], key=lambda s: s.position)})
        except Exception as exc:  # the event retries what failed here, a transient error aside
            if db.transient(exc):
                raise
            log.warning("pipeline run #%d: moving on at its task's end failed, its event retries: %s",
                        run.pk, db.one_line(exc))
            continue
        moved.append(run.pk)
    return moved


def _contexts(cursor: Any, run_ids: list[int]) -> dict[int, str]:
    """The runs' trace contexts, so their advance events sit in the runs' traces."""
    cursor.execute(sql.pipeline(cursor.db).run_traceparents + in_list(run_ids), run_ids)
    return {run_id: traceparent for run_id, traceparent in cursor.fetchall() if traceparent}


def record(job_ids: list[int], using: str, now: Callable[[], datetime]) -> dict[int, int]:
    """Record the outcomes of the queued tasks of these jobs that have ended (a job still
    waiting or running is left alone); returns {run id: a job id} for each run whose
    advance is due. A late outcome (its stage stopped) is recorded and moves nothing.

    Successes and cancellations, the usual endings, take one statement each for the
    whole batch; a failure reads its job's last error and is written alone.
    """
    connection = connections[using]
    st = sql.pipeline(connection)
    with connection.cursor() as cursor:
        cursor.execute(st.ended + in_list(job_ids), job_ids)
        rows = sorted(cursor.fetchall())
        endings = _Endings(rows)
        if not endings.counts:
            return {}
        for kind, ids in endings.kinds.items():
            if ids:
                cursor.execute(getattr(st, kind) + in_list(ids), ids)
                if cursor.rowcount != len(ids):  # each job ends once; nothing else records these
                    log.error("pipelines: recorded %d of %d %s tasks %s", cursor.rowcount, len(ids), kind, ids)
        _record_failures(endings.failed, using, now)
        moving = _count(cursor, endings)
    if signals.task_finished.has_listeners(Run):
        _announce([task_id for task_id, *_ in rows], using)
    return moving


class _Endings:
    """The ended tasks of rows of "ended" (task, run, stage, job, job status), by kind,
    and per stage how many were recorded and failed."""

    def __init__(self, rows: list[tuple]) -> None:
        self.kinds: dict[str, list[int]] = {"succeeded": [], "cancelled": []}
        self.failed: list[tuple[int, int]] = []
        self.counts: dict[int, list[int]] = {}  # stage id -> [recorded, failed]
        self.runs: dict[int, tuple[int, int]] = {}  # stage id -> (run id, a job id)
        for task_id, run_id, stage_id, job_id, status in rows:
            if status == Job.SUCCEEDED:
                self.kinds["succeeded"].append(task_id)
            elif status == Job.CANCELLED:
                self.kinds["cancelled"].append(task_id)
            elif status is None or status in Job.FINISHED:
                self.failed.append((task_id, job_id))
            else:
                continue  # still waiting or running: its end records it
            count = self.counts.setdefault(stage_id, [0, 0])
            count[0] += 1
            count[1] += status != Job.SUCCEEDED
            self.runs[stage_id] = (run_id, job_id)


def _count(cursor: Any, endings: _Endings) -> dict[int, int]:
    """Move the stages' counters; {run id: a job id} of the runs that can move. The stages
    are locked in id order first (one order everywhere, so two recorders cannot deadlock),
    then written by one UPDATE: a stage that no longer runs (its run ended, or it failed)
    counts its tasks done and moves nothing else."""
    connection = cursor.db
    stage_ids = sorted(endings.counts)
    cursor.execute(sql.pipeline(connection).counted + in_list(stage_ids) + " ORDER BY id" + db.for_update(connection),
                   stage_ids)
    counters: dict[int, dict[str, int]] = {}
    moving: dict[int, int] = {}
    for stage_id, run_id, status, pending, waiting, done, failed in cursor.fetchall():
        recorded, bad = endings.counts[stage_id]
        running = status == StageRun.RUNNING
        if running:
            pending, failed = pending - recorded, failed + bad
        counters[stage_id] = {"done": done + recorded, "pending": pending, "failed_tasks": failed}
        if running and (pending == 0 or waiting or bad):
            moving[run_id] = endings.runs[stage_id][1]
    update_each(connection, db.table(StageRun, connection), counters)
    return moving


def _record_failures(failed: list[tuple[int, int]], using: str, now: Callable[[], datetime]) -> None:
    """Record tasks whose jobs failed for good, each with its job's last error; a job
    deleted (discarded) counts as failed, ending now."""
    if not failed:
        return
    job_ids = [job_id for _, job_id in failed]
    jobs = {pk: rest for pk, *rest in Job.objects.using(using).filter(pk__in=job_ids)
            .values_list("pk", "attempt", "started_at", "finished_at")}
    errors = last_errors(jobs, using)
    ended = now() if len(jobs) < len(job_ids) else None
    for task_id, job_id in failed:
        if job_id in jobs:
            attempts, started, finished = jobs[job_id]
            fields = {"error": errors.get(job_id, "failed"), "attempts": attempts, "started_at": started,
                      "finished_at": finished}
        else:
            fields = {"error": f"its job #{job_id} was deleted", "attempts": 0, "started_at": None,
                      "finished_at": ended}
        TaskRun.objects.using(using).filter(pk=task_id, status=TaskRun.QUEUED).update(
            status=TaskRun.FAILED, result=None, **fields)


def _announce(task_ids: list[int], using: str) -> None:
    """Send task_finished for recorded tasks once their transaction commits."""
    tasks = list(TaskRun.objects.using(using).filter(pk__in=task_ids).select_related("run", "stage"))
    for task in tasks:
        after_commit(using, signals.task_finished, run=task.run, stage=task.stage, task=task)
