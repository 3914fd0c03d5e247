"""How the pipelines read runs: rows made into models without the ORM's query building
(the advance event runs once per stage of every run), a run's row locked by writing it,
its definition parsed once per process, and a task's result.

A run's definition never changes, so a process parses it once; (alias, id, queued_at)
names a run even in a database whose ids start over.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any, TypeVar

from django.db import connections, models

from leases import db
from leases.encoding import load_json
from leases.sql import in_list

from . import sql
from .definition import Stage, from_snapshot
from .models import Run, StageRun, TaskRun

M = TypeVar("M", bound=models.Model)

#: A run's stages by name, and each stage's direct requirements.
Definition = tuple[dict[str, Stage], dict[str, tuple[str, ...]]]
#: Parsed definitions kept per process, least recently used dropped first.
DEFINITIONS_KEPT = 1000
_DEFINITIONS: OrderedDict[tuple[str, int, datetime], Definition] = OrderedDict()
_definitions_lock = threading.Lock()


def load(model: type[M], using: str, tail: str, params: list, leave_out: tuple[str, ...] = ()) -> list[M]:
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


#: A run's columns that its steps leave unread: the definition comes from the cache, the
#: context is read when a task needs it.
UNREAD = ("definition", "context")


def locked(run_id: int, using: str) -> Run | None:
    """The run's row, locked by writing it (its revision): on Galera a row lock binds its
    own node only, and two nodes' events about one run are refused at COMMIT, all but one,
    only if they wrote a row in common. Its definition comes from the cache, its context
    unread."""
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(sql.pipeline(connection).lock_run, [run_id])
        if cursor.rowcount != 1:
            return None
    found = load(Run, using, sql.pipeline(connection).run_by_id, [run_id], leave_out=UNREAD)
    return found[0] if found else None


def definition_of(run_id: int, queued_at: Any, using: str, raw: Any = None) -> Definition:
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
            cursor.execute(sql.pipeline(connection).definition, [run_id])
            raw = cursor.fetchone()[0]
    pipeline = from_snapshot(load_json(raw))
    parsed = {stage.name: stage for stage in pipeline.stages}, pipeline.requires()
    with _definitions_lock:
        _DEFINITIONS[key] = parsed
        while len(_DEFINITIONS) > DEFINITIONS_KEPT:
            _DEFINITIONS.popitem(last=False)
    return parsed


def read_definitions(cursor: Any, runs: dict[int, Any]) -> None:
    """Parse and keep the definitions of these runs ({id: queued_at}) that this process
    has not parsed yet, with one read for all of them."""
    using = cursor.db.alias
    with _definitions_lock:
        missing = [run_id for run_id, queued_at in runs.items()
                   if (using, run_id, db.to_datetime(queued_at)) not in _DEFINITIONS]
    if missing:
        cursor.execute(sql.pipeline(cursor.db).definitions + in_list(missing), missing)
        for run_id, raw in cursor.fetchall():
            definition_of(run_id, runs[run_id], using, raw)


def definition(run: Run) -> Definition:
    return definition_of(run.pk, run.queued_at, run._state.db, run.__dict__.get("definition"))


def stages(run: Run, using: str) -> dict[str, StageRun]:
    """The run's stages by name, in definition order."""
    tail = sql.pipeline(connections[using]).run_stages
    return {stage.name: stage for stage in load(StageRun, using, tail, [run.pk])}


def result(run_id: int, specs: dict[str, Stage], task: str, using: str) -> Any:
    """A task's result: one value, or for a for_each stage's task a list in item order
    (None for an item that did not succeed)."""
    many = any(spec.for_each is not None and task in spec.tasks for spec in specs.values())
    rows = TaskRun.objects.using(using).filter(run_id=run_id, task=task).order_by("position")
    rows = rows.values_list("status", "result")
    if many:
        return [value if status == TaskRun.SUCCEEDED else None for status, value in rows]
    found = rows.first()
    return found[1] if found and found[0] == TaskRun.SUCCEEDED else None
