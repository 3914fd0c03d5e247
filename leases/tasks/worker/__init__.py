"""The worker process of the job queue (`manage.py leases_worker`): `loop` claims, runs and
writes outcomes on its timers, `threads` run the handlers, `report` says what happened.
It holds no SQL: every statement is a stage of `leases.tasks.jobs`.

`Worker` is the name this class had before the queue's process rows (the model
`leases.tasks.models.Worker`) needed theirs: old imports keep working.
"""
from leases.routing import database_of

from .loop import MIN_TTL, JobWorker
from .report import Stats
from .threads import execute, handler_for

Worker = JobWorker

__all__ = ["MIN_TTL", "JobWorker", "Stats", "Worker", "database_of", "execute", "handler_for"]
