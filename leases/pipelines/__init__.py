"""leases.pipelines: stages of serial or parallel tasks on the job queue.

Public names are imported lazily so the app can sit in INSTALLED_APPS.
"""
from leases import lazy_exports

_EXPORTS = {
    "Pipeline": "leases.pipelines.definition",
    "Stage": "leases.pipelines.definition",
    "cancelled": "leases.pipelines.payload",
    "get": "leases.pipelines.definition",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports("leases.pipelines", _EXPORTS)
