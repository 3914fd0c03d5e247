"""The no-op handler of bench/peers_celery.py, in a module of its own so the bench's
`manage.py leases_worker` processes import it (`--import bench.peers_celery_handlers`)
without running the bench."""
from __future__ import annotations

from typing import Any

from leases.tasks.registry import handler

QUEUE = "bench-celery"
NAME = "bench.celery.noop"


@handler(NAME, queue=QUEUE, max_attempts=1)
def noop(payload: Any) -> None:
    """Nothing: the bench measures the queue, not the work, as Celery's no-op task does."""
    return None
