"""What a pipeline task's handler receives, built when its job runs (the stored payload
names only the run, stage and task): the run's context, the results of every task of the
stages it depends on (read when the handler first looks one up), its item in a for_each
stage, the run's id and its stage. One read: the definition is cached per process.

A handler's limit key that is a function of its payload is computed from this same
payload when the task's job is made (`limit_payloads`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

from django.db import connections

from leases import db
from leases.encoding import load_json
from leases.exceptions import Fail
from leases.sql import in_list
from leases.tasks import registry

from . import sql, store
from .definition import Stage, upstream
from .models import Run, TaskRun


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
            self._loaded[task] = store.result(self._run_id, self._specs, task, self._using)
        return self._loaded[task]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __repr__(self) -> str:
        return f"Results({self._tasks})"


def _payload(run_id: int, stage: str, context: Any, item: Any, definition: store.Definition,
             using: str) -> dict[str, Any]:
    specs, requires = definition
    names = [t for name in specs if name in upstream(stage, requires) for t in specs[name].tasks]
    payload = {"context": context, "results": Results(run_id, specs, names, using), "run": run_id, "stage": stage}
    if specs[stage].for_each is not None:
        payload["item"] = item
    return payload


def read_tasks(cursor: Any, jobs: list[Any]) -> None:
    """The claim reader of task jobs (`leases.tasks.registry.add_claim_reader`): what each
    handler needs that changes, read for the batch in the claim's transaction and kept on
    the job (`task_payload`'s `row`), and the definitions of runs this process has not
    parsed yet; a task gone keeps None and is read again at its start. So a task whose
    handler reads no results uses no connection in its thread."""
    ids = [job.payload["task"] for job in jobs]
    cursor.execute(sql.pipeline(cursor.db).tasks + in_list(ids), ids)
    rows = {row[0]: row[1:] for row in cursor.fetchall()}
    runs = {}
    for job in jobs:
        job.read = rows.get(job.payload["task"])
        if job.read is not None:
            runs[job.payload["run"]] = job.read[-1]  # its queued_at names the run's definition
    store.read_definitions(cursor, runs)


def task_payload(stored: dict[str, Any], using: str | None = None, row: tuple | None = None) -> dict[str, Any]:
    """What a task's handler receives, from its job's stored payload (and `row`, when its
    claim read it: `read_tasks`); Fail when the task is no longer wanted (its run ended,
    its stage was restarted)."""
    using = db.alias(using)
    if row is None:
        connection = connections[using]
        with connection.cursor() as cursor:
            cursor.execute(sql.pipeline(connection).task, [stored["task"]])
            row = cursor.fetchone()
    run_id = stored["run"]
    if row is not None and row[2] not in Run.LIVE:
        raise Fail(f"pipeline run #{run_id} has {row[2]}")
    if row is None or row[0] != TaskRun.QUEUED:
        raise Fail(f"task #{stored['task']} of pipeline run #{run_id} is no longer wanted")
    _, item, _, context, queued_at = row
    definition = store.definition_of(run_id, queued_at, using)
    return _payload(run_id, stored["stage"], load_json(context), load_json(item), definition, using)


def limit_payloads(run: Run, stage: str, task_ids: list[int], using: str) -> dict[int, dict[str, Any]]:
    """What each task's handler will receive, by task id, for limit keys computed from it
    when the tasks' jobs are made: one read of their items, the run's context once."""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.pipeline(connection).items + in_list(task_ids), task_ids)
        items = {task_id: load_json(item) for task_id, item in cursor.fetchall()}
    context = Run.objects.using(using).values_list("context", flat=True).get(pk=run.pk)
    definition = store.definition(run)
    return {task_id: _payload(run.pk, stage, context, items.get(task_id), definition, using) for task_id in task_ids}


class PipelineTask:
    """Runs a pipeline task's job for the worker: its handler's function, with the
    payload built when it runs; the handler's timeout and backoff apply."""

    def __init__(self, spec: registry.Handler) -> None:
        self.spec = spec
        self.timeout = spec.timeout
        self.is_async = spec.is_async  # run() then returns the coroutine the worker awaits

    def delay(self, attempt: int) -> float:
        return self.spec.delay(attempt)

    def run(self, job: Any) -> Any:
        payload = task_payload(job.payload, job.using or None, job.read)
        if self.spec.takes_context:  # its context, its lease included (a handler with `lease=`)
            return self.spec.func(payload, ctx=job.context)
        return self.spec.func(payload)


def task_runner(job: Any) -> PipelineTask:
    """The worker's entry point for a job whose `backend` is a pipeline task's."""
    return PipelineTask(registry.get(job.name))


def cancelled(payload: dict[str, Any], using: str | None = None) -> bool:
    """Whether the run of this task's payload was cancelled (a long handler asks now and
    then, and stops early)."""
    status = Run.objects.using(db.alias(using)).filter(pk=payload["run"]).values_list("status", flat=True).first()
    return status in (None, Run.CANCELLED)
