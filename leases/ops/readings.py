"""How each app adds its part to the dashboard and to the Prometheus metrics.

The base app knows nothing of the apps built on it: each one, when ready, adds here the
panels it draws on the dashboard (`add_panels`) and the metric families it exposes
(`add_metrics`), with an order number that places them among the others; the base app's
own are in `pools`. This module imports no model, so that adding never loads an app that
is missing (the system checks say so instead).

Every reading is one grouped query through an existing index (or a small table), a fixed
number per page or scrape however many rows the tables hold, and every time is judged by
the one reading of the database clock the caller passes in. Only the metric families need
`prometheus_client` (the optional extra ``django-leases[metrics]``): it is imported where
they are built, never here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from .charts import Panel

#: Finished jobs and runs are counted over this window (a gauge, not a counter: rows are
#: pruned, so a lifetime total could not be read back from the tables).
WINDOW = timedelta(hours=1)

#: Panels of an app, drawn at (now by the database clock, database alias).
PanelMaker = Callable[[datetime, str], list[Panel]]
#: Metric families (prometheus_client's) of an app, read at (now, database alias).
MetricsCollector = Callable[[datetime, str], Iterable[Any]]

_panels: dict[PanelMaker, int] = {}
_metrics: dict[MetricsCollector, int] = {}


def add_panels(order: int, make: PanelMaker) -> None:
    """Draw `make`'s panels on the dashboard before those of a higher `order`. Keyed by
    the function: ready() runs again when a test changes INSTALLED_APPS."""
    _panels[make] = order


def add_metrics(order: int, collect: MetricsCollector) -> None:
    """Expose `collect`'s metric families, before those of a higher `order`."""
    _metrics[collect] = order


def panels(now: datetime, using: str) -> list[Panel]:
    """Every panel of the installed apps, in their order."""
    return [panel for make in sorted(_panels, key=_panels.__getitem__) for panel in make(now, using)]


def metric_families(now: datetime, using: str) -> Iterator[Any]:
    """Every metric family of the installed apps, in their order."""
    for collect in sorted(_metrics, key=_metrics.__getitem__):
        yield from collect(now, using)
