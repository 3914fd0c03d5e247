"""The pipelines' own jobs, on the queue like any other: the event that advances a run,
and the start of a run a schedule's tick asked for.

A scheduled start goes on the queue of the run's first tasks (`start_queue`), as the
advance event goes on its task's queue: the workers that do a pipeline's work start its
scheduled runs, and no worker of another queue is needed for it."""
from leases.tasks import registry
from leases.tasks.registry import handler

from . import definition, machine

#: The handler whose job starts a scheduled run (the pipelines' schedule target).
START = "leases.pipelines.start"


@handler(machine.EVENT, max_attempts=machine.EVENT_ATTEMPTS, backoff=lambda attempt: min(30.0, 0.25 * 2**attempt),
         internal=True)
def advance(payload: dict) -> None:
    """Move a run on once its tasks' outcomes are recorded. It must not be lost, so it
    is retried for a long time (the run waits for it)."""
    machine.advance_event(payload["run"])


@handler(START, max_attempts=5, internal=True)
def start(payload: dict) -> dict:
    """Start a run of a pipeline (a schedule's tick). The key makes a retry after a lost
    reply find the run it started rather than start another."""
    run = definition.get(payload["pipeline"]).start(context=payload.get("context"), key=payload.get("key"))
    return {"run": run.pk, "created": run.created}


def start_queue(name: str) -> str | None:
    """The queue of the scheduled start of pipeline `name` (a schedule without its own
    `queue`): that of the first task of its first stage that requires none. None when
    this process knows neither the pipeline nor that task's handler."""
    try:
        pipeline = definition.get(name)
    except ValueError:
        return None
    requires = pipeline.requires()
    first = next(stage for stage in pipeline.stages if not requires[stage.name])
    spec = registry.find(first.tasks[0])
    return spec.queue if spec is not None else None
