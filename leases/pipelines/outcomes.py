"""A task's end: recorded in the transaction that ends its job for good (succeeded,
failed, dead, cancelled, discarded), by the finisher this app registers for its tasks'
jobs, so a task's end cannot be lost between the job and the pipeline.

Outcomes are recorded without the run's lock: a task leaves "queued" once, by a
conditional UPDATE, and its stage's counters move in the same transaction. Whoever brings
a stage's `pending` to zero, records a failure, or frees a slot of a stage with tasks
still waiting queues the run's advance event (one waits per run: a second push merges
into it), so the run moves once its outcomes are all in.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Callable

from django.db import connections

from leases import clock
from leases.sql import in_list
from leases.tasks import tracing
from leases.tasks.jobs.outcomes import last_errors
from leases.tasks.jobs.push import new_job, write
from leases.tasks.models import PRIORITY_RANGE, Job

from . import signals, sql
from .machine import EVENT, after_commit
from .models import Run, StageRun, TaskRun

log = logging.getLogger("leases.pipelines")


def tasks_ended(cursor: Any, ended: list[tuple[int, str]]) -> None:
    """The finisher of task jobs (`leases.tasks.registry.add_finisher`): record how each
    ended, in the transaction that ended it, and queue the advance event of each run that
    can move, on the queue of one of its tasks (which a worker serves), ahead of work."""
    moving = record([job_id for job_id, _ in ended], cursor.db.alias, lambda: clock.now(cursor))
    if not moving:
        return
    queues = dict(ended)
    contexts = _contexts(cursor, sorted(moving)) if tracing.enabled() else {}
    write(cursor, [
        new_job(EVENT, {"run": run_id}, queue=queues[job_id], key=f"{EVENT}:{run_id}", priority=PRIORITY_RANGE[1],
                traceparent=contexts.get(run_id))
        for run_id, job_id in sorted(moving.items())
    ])


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
    """Move the stages' counters; {run id: a job id} of the runs that can move."""
    st = sql.pipeline(cursor.db)
    for stage_id in sorted(endings.counts):  # one order everywhere, so two recorders cannot deadlock
        done, bad = endings.counts[stage_id]
        cursor.execute(st.count, [done, done, bad, stage_id])
    stage_ids = sorted(endings.counts)
    cursor.execute(st.stages + in_list(stage_ids), stage_ids)
    moving: dict[int, int] = {}
    for stage_id, run_id, status, pending, waiting in cursor.fetchall():
        if status == StageRun.RUNNING and (pending == 0 or waiting or endings.counts[stage_id][1]):
            moving[run_id] = endings.runs[stage_id][1]
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
