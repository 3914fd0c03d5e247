"""The engine's event, a job on the queue like any other (see `engine`)."""
from leases.tasks.registry import handler

from . import definition, engine


@handler(engine.EVENT, max_attempts=engine.EVENT_ATTEMPTS, backoff=lambda attempt: min(30.0, 0.25 * 2**attempt))
def advance(payload: dict) -> None:
    """Move a run on once its tasks' outcomes are recorded. It must not be lost, so it
    is retried for a long time (the run waits for it)."""
    engine.advance(payload["run"])


@handler("leases.pipelines.start", max_attempts=5)
def start(payload: dict) -> dict:
    """Start a run of a pipeline (a schedule's tick). The key makes a retry after a lost
    reply find the run it started rather than start another."""
    run = definition.get(payload["pipeline"]).start(context=payload.get("context"), key=payload.get("key"))
    return {"run": run.pk, "created": run.created}
