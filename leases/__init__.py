"""django-leases: resource leases, locks and work dispatch through the SQL database.

The public names are imported lazily, so that ``leases`` can sit in INSTALLED_APPS and
``from leases import Pool`` works in code that runs after Django is set up.
"""
from importlib import import_module
from typing import Any, Callable

__version__ = "0.1.0"

_EXPORTS = {
    "Pool": "leases.pool",
    "Lease": "leases.lease",
    "ResourceThread": "leases.thread",
    "AsyncHolder": "leases.holder",
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
    "configure": "leases.setup",
    "create_tables": "leases.setup",
}

__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` importing `exports` (name -> module) on first use."""

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        return getattr(import_module(module), name)

    return __getattr__


__getattr__ = lazy_exports("leases", _EXPORTS)
