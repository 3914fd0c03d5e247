"""The engine's event, a job on the queue like any other (see `engine`)."""
from leases.tasks.registry import handler

from . import engine


@handler(engine.EVENT, max_attempts=1000, backoff=lambda attempt: min(30.0, 0.25 * 2**attempt))
def task_finished(payload: dict) -> None:
    """A task's job ended for good: record it and advance the run. It must not be lost,
    so it is retried for a long time (the run waits for it)."""
    engine.task_finished(payload["job"])
