"""The handlers and the pipeline of bench/peers.py's side for django-leases, in a module of
their own so the bench's `manage.py leases_worker` processes import them (`--import
bench.peer_leases_handlers`) without running the bench.

The pipeline is the shape Celery's side builds as a canvas (bench/peer_celery.py): 3
stages of 4 no-op tasks side by side, one after another, then a final task.
"""
from __future__ import annotations

from typing import Any

from leases.pipelines import Pipeline, Stage
from leases.tasks.registry import handler

QUEUE = "bench-peers"
NAME = "bench.peers.noop"
STAGES, WIDTH = 3, 4
TASKS_PER_RUN = STAGES * WIDTH + 1


def _noop(payload: Any) -> None:
    """Nothing: the bench measures the queue and the engine, not the work, as Celery's
    and Procrastinate's no-op tasks do."""


handler(NAME, queue=QUEUE, max_attempts=1)(_noop)
STAGE_TASKS = [[f"bench.peers.s{s}t{t}" for t in range(1, WIDTH + 1)] for s in range(1, STAGES + 1)]
FINAL = "bench.peers.final"
for _name in [task for tasks in STAGE_TASKS for task in tasks] + [FINAL]:
    handler(_name, queue=QUEUE, max_attempts=1)(_noop)

PIPELINE = Pipeline("bench-peers-3x4-1", [
    *(Stage(f"s{s}", tasks, parallel=True) for s, tasks in enumerate(STAGE_TASKS, start=1)),
    Stage("final", [FINAL]),
])
