"""leases.tasks: work for crawler fleets and pipelines, kept in the SQL database.

Public names are imported lazily so the app can sit in INSTALLED_APPS.
"""
from importlib import import_module
from typing import Any

_EXPORTS = {
    "Dispatcher": "leases.tasks.dispatcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'leases.tasks' has no attribute {name!r}") from None
    return getattr(import_module(module), name)
