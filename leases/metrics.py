"""The documented import path of the Prometheus collector (``leases.metrics.LeasesCollector``)
and view; both live in `leases.ops.metrics`."""
from .ops.metrics import LeasesCollector, metrics

__all__ = ["LeasesCollector", "metrics"]
