"""leases.tasks: work for crawler fleets and pipelines, kept in the SQL database.

Public names are imported lazily so the app can sit in INSTALLED_APPS.
"""
from leases import lazy_exports

_EXPORTS = {
    "Dispatcher": "leases.tasks.dispatcher",
    "push": "leases.tasks.queue",
    "push_many": "leases.tasks.queue",
    "handler": "leases.tasks.registry",
    "schedule": "leases.tasks.schedules",
    "unschedule": "leases.tasks.schedules",
    "Worker": "leases.tasks.worker",
    "QueueFull": "leases.exceptions",
    "Fail": "leases.exceptions",
    "BadResult": "leases.exceptions",
    "UnknownHandler": "leases.exceptions",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports("leases.tasks", _EXPORTS)
