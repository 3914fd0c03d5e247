"""A job's history: each key keeps its newest LEASES_KEEP_RUNS finished runs (trimmed by the
workers as keys finish), and `leases_prune` deletes what finished long ago, in batches."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable

from django.db import connections

from leases import clock, conf, db
from leases.sql import in_list

from .. import sql
from . import steps


def _delete(ids: list, using: str | None) -> int:
    if not ids:
        return 0

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.jobs(cursor.db)
        with db.write_transaction(cursor.db.alias):
            cursor.execute(st.delete_errors + in_list(ids), ids)
            steps.delete_with(cursor, ids)
            cursor.execute(st.delete_finished + in_list(ids), ids)
            return cursor.rowcount

    return db.run(work, using)


def _select_ids(statement: str, params: tuple, using: str | None) -> list:
    def work(cursor: Any, resumed: bool) -> list:
        cursor.execute(getattr(sql.jobs(cursor.db), statement), params)
        return [row[0] for row in cursor.fetchall()]

    return db.run(work, using)


def trim_runs(keys: Iterable[str], keep: int | None = None, using: str | None = None) -> int:
    """Delete finished runs of each key beyond the newest `keep` (LEASES_KEEP_RUNS)."""
    keep = conf.keep_runs() if keep is None else keep
    keys = sorted(set(keys))
    deleted = 0
    for start in range(0, len(keys), 500):
        for key in _keys_over(keys[start : start + 500], keep, using):
            while ids := _select_ids("old_runs_of_key", (key, keep), using):
                deleted += _delete(ids, using)
    return deleted


def _keys_over(keys: list[str], keep: int, using: str | None) -> list[str]:
    """The keys with more than `keep` finished runs: one index lookup per key, one query."""

    def work(cursor: Any, resumed: bool) -> list[str]:
        st = sql.jobs(cursor.db)
        cursor.execute(st.keys_over + in_list(keys) + st.keys_over_tail, (*keys, keep))
        return [row[0] for row in cursor.fetchall()]

    return db.run(work, using)


def prune(
    older_than: float,
    batch_size: int = 1000,
    using: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete jobs finished more than `older_than` seconds ago, in batches; returns the count.

    The cutoff is taken from the server clock once, so the batches agree on it.
    """
    cutoff = db.dialect(connections[db.alias(using)]).stored_datetime(
        clock.db_now(using) - timedelta(seconds=older_than)
    )
    deleted = 0
    while ids := _select_ids("finished_before", (cutoff, batch_size), using):
        count = _delete(ids, using)
        deleted += count
        if progress:
            progress(count)
    return deleted
