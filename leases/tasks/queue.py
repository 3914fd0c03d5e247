"""The job queue's public functions under the import path the documentation gives
(`leases.tasks.queue.retry(ids)`, `buffered()`, ...). They live in `leases.tasks.jobs`,
one module per stage of a job's life."""
from .jobs.actions import cancel, discard, retry, select_batches
from .jobs.history import prune, trim_runs
from .jobs.push import buffered, flush_buffer, push, push_many
from .jobs.queues import all_queues, forget_settings, queue_settings

__all__ = ["all_queues", "buffered", "cancel", "discard", "flush_buffer", "forget_settings", "prune", "push",
           "push_many", "queue_settings", "retry", "select_batches", "trim_runs"]
