"""django-leases: resource leases, locks and work dispatch through the SQL database.

The public names are imported lazily, so that ``leases`` can sit in INSTALLED_APPS and
``from leases import Pool`` works in code that runs after Django is set up.
"""
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Pool": "leases.pool",
    "Lease": "leases.lease",
    "ResourceThread": "leases.thread",
    "LeaseError": "leases.exceptions",
    "LeaseLost": "leases.exceptions",
    "NoResourceAvailable": "leases.exceptions",
    "UnknownPool": "leases.exceptions",
    "UnknownResource": "leases.exceptions",
    "Locked": "leases.exceptions",
    "lock": "leases.locks",
    "synchronized": "leases.locks",
    "break_lock": "leases.locks",
    "HeldLock": "leases.locks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'leases' has no attribute {name!r}") from None
    return getattr(import_module(module), name)
