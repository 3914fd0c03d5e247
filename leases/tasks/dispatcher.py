"""The pool/bucket dispatcher: hand task ids to crawler workers, lowest score first.

A dispatcher has a pool of scored task ids and a bucket per worker. One table row per
task says where it is (pool, the bucket of one worker, or done), so a task can never be
in two buckets, or in a bucket and the pool at once, and nothing is lost between them.

Concurrency: row locks, not one dispatcher-wide lock (the Redis design this replaces). A worker's claim is one
short transaction, ``SELECT ... ORDER BY score LIMIT n FOR UPDATE SKIP LOCKED`` then an
UPDATE of the rows it got, so workers claim side by side instead of queueing on one
lock (bench/dispatch.py measures both). Rebuilds take the named lock
``dispatch-rebuild:<name>`` from `leases.locks`, so only one runs at a time; they upsert
in batches and never block claims for longer than one batch.
"""
from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping

from django.db import IntegrityError, connections
from django.db.models import Count

from leases import db, routing
from leases.locks import lock
from leases.sql import in_list
from leases.validation import check_name, check_seconds

from . import sql
from .models import NAME_LENGTH, VALUE_LENGTH, WORKER_LENGTH, DispatchWorker, PoolTask, TaskPool

log = logging.getLogger("leases.tasks")

POOL, BUCKET, DONE = PoolTask.POOL, PoolTask.BUCKET, PoolTask.DONE

def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"limit must be a whole number > 0, not {limit!r}")
    return limit


def check_score(value: str, score: Any) -> float:
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise ValueError(f"score of task {value!r} must be a finite number, not {score!r}")
    return float(score)


def seconds(value: float | timedelta, what: str) -> float:
    return check_seconds(value, what, above=True)


class Dispatcher:
    """A named pool of task ids, a router and a bucket per worker.

    `stale_after` (seconds): a worker not seen for that long loses its bucket to the
    pool; `assign_tasks` runs that reclaim on its own every `stale_after / 4` seconds.
    """

    def __init__(
        self,
        name: str,
        using: str | None = None,
        stale_after: float | timedelta = 600,
        batch_size: int = 1000,
    ) -> None:
        self.name = check_name(name, "dispatcher name", NAME_LENGTH)
        self.using = routing.route("dispatchers", self.name, using)
        self.stale_after = seconds(stale_after, "stale_after")
        self.batch_size = check_limit(batch_size)
        self._next_reclaim = 0.0

    def __repr__(self) -> str:
        return f"<Dispatcher {self.name}>"

    def _run(self, key: str, params: tuple, fetch: str | None = None) -> Any:
        """One statement in autocommit, retried on transient errors."""

        def work(cursor: Any, resumed: bool) -> Any:
            cursor.execute(getattr(sql.dispatch(cursor.db), key), params)
            return cursor.fetchall() if fetch == "all" else cursor.rowcount

        return db.run(work, self.using)

    # -- the pool ---------------------------------------------------------------------

    def recreate_task_pool(
        self,
        mapping: Mapping[str, float] | Callable[[], Mapping[str, float]],
        wait: float = 0,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Replace the pool with `mapping` ({task: score}), leaving out tasks in buckets.

        `mapping` may be a callable: it is called once the rebuild has begun, so a task
        finished (`tasks_done`) while it reads its source is not put back in the pool.
        A dict is validated before anything is written (a callable's mapping, once it is
        called, before any task is written). Only one rebuild of a dispatcher
        runs at a time: Locked("PROCESSING LOCKED: ...") after `wait` seconds. Returns the
        number of tasks listed.
        """
        rows = None if callable(mapping) else self._rows(mapping)
        with lock(f"dispatch-rebuild:{self.name}", ttl=120, wait=wait, using=self.using) as held:
            TaskPool.objects.using(self.using).get_or_create(name=self.name)
            self._run("start_rebuild", (self.name,))
            ((generation, started),) = self._run("rebuild_started", (self.name,), fetch="all")
            if rows is None:
                rows = self._rows(mapping())
            conn = connections[self.using]
            since = db.dialect(conn).stored_datetime(db.to_datetime(started))
            written = 0
            for batch in _chunks(rows, self.batch_size):
                self._upsert(batch, generation, since)
                written += len(batch)
                held.extend()
                if progress:
                    progress(len(batch))
                log.info("dispatcher %s: rebuild wrote %d/%d tasks", self.name, written, len(rows))
            dropped = self._delete_all("unlisted", POOL, generation)
            self._delete_all("old_done", DONE, since)
            self._run("rebuilt", (self.name,))
            log.info("dispatcher %s: pool rebuilt with %d tasks, %d unlisted dropped", self.name, len(rows), dropped)
            return len(rows)

    @staticmethod
    def _rows(mapping: Mapping[str, float]) -> list[tuple[str, float]]:
        """(task, score) pairs, each checked: a bad one is a ValueError before any write."""
        return [(check_name(v, "task", VALUE_LENGTH), check_score(v, s)) for v, s in mapping.items()]

    def _upsert(self, batch: list[tuple[str, float]], generation: int, since: Any) -> None:
        params: list = []
        for value, score in batch:
            params += [self.name, value, score, generation]

        def work(cursor: Any, resumed: bool) -> None:
            st = sql.dispatch(cursor.db)
            rows = ", ".join([st.upsert_row] * len(batch))
            cursor.execute(st.upsert + rows + st.upsert_tail, (*params, since, since, since, generation))

        db.run(work, self.using)

    def _delete_all(self, select: str, state: int, param: Any) -> int:
        """Delete in batches what `select` finds, so no statement holds many row locks."""
        deleted = 0
        while ids := [row[0] for row in self._run(select, (self.name, param, self.batch_size), fetch="all")]:
            deleted += self._run_in("delete", (state,), ids)
        return deleted

    def _run_in(self, key: str, params: tuple, ids: list, more: str = "") -> int:
        """`key`'s statement + `more`, completed with an IN list of `ids`; the row count."""

        def work(cursor: Any, resumed: bool) -> int:
            statement = getattr(sql.dispatch(cursor.db), key) + more + in_list(ids)
            cursor.execute(statement, (*params, *ids))
            return cursor.rowcount

        return db.run(work, self.using)

    # -- workers ----------------------------------------------------------------------

    def assign_tasks(self, limit: int, worker: str) -> list[str]:
        """The worker's bucket, topped up to `limit` from the pool (lowest score first).

        Above `limit`, the excess is trimmed from the end of the bucket back to the pool.
        """
        check_limit(limit)
        check_name(worker, "worker name", WORKER_LENGTH)
        if time.monotonic() >= self._next_reclaim:
            self.reclaim()
        self._touch(worker)
        return db.run(self._assigner(limit, worker), self.using)

    def _touch(self, worker: str) -> None:
        if self._run("touch_worker", (self.name, worker)):
            return
        try:
            self._run("add_worker", (self.name, worker))
        except IntegrityError:
            pass  # registered by a concurrent call of the same worker

    def _assigner(self, limit: int, worker: str) -> Callable[[Any, bool], list[str]]:
        def work(cursor: Any, resumed: bool) -> list[str]:
            st = sql.dispatch(cursor.db)
            with db.write_transaction(self.using):
                cursor.execute(st.bucket, (self.name, worker))
                bucket = cursor.fetchall()
                if len(bucket) < limit:
                    cursor.execute(st.lowest_in_pool, (self.name, limit - len(bucket)))
                    picked = [row[0] for row in cursor.fetchall()]
                    if picked:
                        cursor.execute(st.to_bucket + in_list(picked), (worker, *picked))
                        # Without SKIP LOCKED a concurrent claim may win some: read back.
                        cursor.execute(st.bucket, (self.name, worker))
                        bucket = cursor.fetchall()
                elif len(bucket) > limit:
                    excess = [row[0] for row in bucket[limit:]]
                    cursor.execute(st.back_to_pool + in_list(excess), (worker, *excess))
                    bucket = bucket[:limit]
            return [value for _, value in bucket]

        return work

    def check_tasks(self, worker: str, tasks: Iterable[str]) -> bool:
        """True when the worker's bucket holds exactly `tasks`, no more, no fewer."""
        return sorted(self.bucket(worker)) == sorted(tasks)

    def bucket(self, worker: str) -> list[str]:
        """The tasks in the worker's bucket, in bucket order."""
        return [value for _, value in self._run("bucket", (self.name, worker), fetch="all")]

    def tasks_done(self, worker: str, tasks: Iterable[str] | None = None) -> int:
        """Take `tasks` (all when None) out of the worker's bucket as done; returns how many."""
        check_name(worker, "worker name", WORKER_LENGTH)
        if tasks is None:
            return self._run("done", (self.name, worker))
        chunks = _chunks(list(tasks), self.batch_size)
        return sum(self._run_in("done", (self.name, worker), chunk, " AND value IN (") for chunk in chunks)

    def reclaim(self, stale_after: float | timedelta | None = None) -> int:
        """Return the buckets of workers not seen for `stale_after` seconds to the pool."""
        stale = self.stale_after if stale_after is None else seconds(stale_after, "stale_after")
        self._next_reclaim = time.monotonic() + stale / 4
        ago = db.dialect(connections[self.using]).seconds(-stale)
        returned = self._run("reclaim", (self.name, self.name, ago))
        self._run("forget_workers", (self.name, ago))
        if returned:
            log.warning("dispatcher %s: %d tasks of workers unseen for %gs back in the pool", self.name, returned, stale)
        return returned

    def stats(self) -> dict[str, Any]:
        """Pool size, assigned and done counts, and each worker's bucket size and last seen."""
        counts = dict(self._run("counts", (self.name,), fetch="all"))
        sizes = dict(
            PoolTask.objects.using(self.using)
            .filter(dispatcher=self.name, state=BUCKET)
            .values_list("worker")
            .annotate(n=Count("id"))
        )
        workers = DispatchWorker.objects.using(self.using).filter(dispatcher=self.name)
        return {
            "dispatcher": self.name,
            "pool": counts.get(POOL, 0),
            "assigned": counts.get(BUCKET, 0),
            "done": counts.get(DONE, 0),
            "workers": {
                w.name: {"bucket": sizes.pop(w.name, 0), "last_seen": w.last_seen.isoformat()} for w in workers
            },
        }
