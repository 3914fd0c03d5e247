"""leases.tasks: work for crawler fleets and pipelines, kept in the SQL database.

Public names are imported lazily so the app can sit in INSTALLED_APPS.
"""
from leases import lazy_exports

_EXPORTS = {
    "Dispatcher": "leases.tasks.dispatcher",
    "push": "leases.tasks.jobs.push",
    "push_many": "leases.tasks.jobs.push",
    "handler": "leases.tasks.registry",
    "schedule": "leases.tasks.schedules",
    "unschedule": "leases.tasks.schedules",
    "JobWorker": "leases.tasks.worker",
    "Worker": "leases.tasks.worker",  # JobWorker's name before the process rows' model took it
    "QueueFull": "leases.exceptions",
    "Fail": "leases.exceptions",
    "BadResult": "leases.exceptions",
    "UnknownHandler": "leases.exceptions",
    "Needs": "leases.tasks.needs",
    "Banned": "leases.exceptions",
    "JobContext": "leases.tasks.context",
    "send_event": "leases.tasks.jobs.steps",
    "wait": "leases.tasks.jobs.results",
    "Cancelled": "leases.exceptions",
    "TimedOut": "leases.exceptions",
    "StepMismatch": "leases.exceptions",
    "JobFailed": "leases.exceptions",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports("leases.tasks", _EXPORTS)
