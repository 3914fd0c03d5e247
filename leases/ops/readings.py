"""How each app adds its part to the dashboard and to the Prometheus metrics.

The base app knows nothing of the apps built on it: each one, when ready, adds here the
panels it draws on the dashboard (`add_panels`) and the metric families it exposes
(`add_metrics`), with an order number that places them among the others; the base app's
own are in `pools`. Each reading declares, with `needs`, the permission a viewer must
hold to see it: the view permission of the model it reads, so the dashboard and the
metrics show a user what the admin would, and nothing of models they may not view. This
module imports no model, so that adding never loads an app that is missing (the system
checks say so instead).

Every reading is one grouped query through an existing index (or a small table), a fixed
number per page or scrape however many rows the tables hold, and every time is judged by
the one reading of the database clock the caller passes in. Only the metric families need
`prometheus_client` (the optional extra ``django-leases[metrics]``): it is imported where
they are built, never here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured

from .charts import Panel

#: Finished jobs and runs are counted over this window (a gauge, not a counter: rows are
#: pruned, so a lifetime total could not be read back from the tables).
WINDOW = timedelta(hours=1)

#: Panels of an app, drawn at (now by the database clock, database alias).
PanelMaker = Callable[[datetime, str], list[Panel]]
#: Metric families (prometheus_client's) of an app, read at (now, database alias).
MetricsCollector = Callable[[datetime, str], Iterable[Any]]
#: Whether the viewer holds a permission ("app_label.codename"): `user.has_perm`.
May = Callable[[str], bool]
Reading = TypeVar("Reading", bound=Callable[..., Any])

#: Each reading's (order, permission).
_panels: dict[PanelMaker, tuple[int, str]] = {}
_metrics: dict[MetricsCollector, tuple[int, str]] = {}


def everything(permission: str) -> bool:
    """The viewer who may see every reading: the metrics' bearer token, a collector
    registered in a project's own registry."""
    return True


def needs(permission: str) -> Callable[[Reading], Reading]:
    """Declare the permission a viewer needs to see a reading (a panel maker or a metrics
    collector): the view permission of the model it reads, e.g. "leases.view_resource"."""
    def declare(reading: Reading) -> Reading:
        reading.permission = permission  # type: ignore[attr-defined]
        return reading

    return declare


def _declared(reading: Callable[..., Any]) -> str:
    permission = getattr(reading, "permission", "")
    if not permission:
        raise ImproperlyConfigured(
            f"{reading.__module__}.{reading.__qualname__} declares no permission: decorate it with"
            " @leases.ops.readings.needs('app_label.view_model')"
        )
    return permission


def add_panels(order: int, make: PanelMaker) -> None:
    """Draw `make`'s panels on the dashboard before those of a higher `order`, for viewers
    who hold the permission it `needs`. Keyed by the function: ready() runs again when a
    test changes INSTALLED_APPS."""
    _panels[make] = (order, _declared(make))


def add_metrics(order: int, collect: MetricsCollector) -> None:
    """Expose `collect`'s metric families, before those of a higher `order`, to viewers
    who hold the permission it `needs`."""
    _metrics[collect] = (order, _declared(collect))


def _shown(readings: dict[Reading, tuple[int, str]], may: May) -> list[Reading]:
    """The readings `may` allows, in their order; each permission asked once."""
    allowed = {permission: may(permission) for _, permission in readings.values()}
    ordered = sorted(readings, key=readings.__getitem__)
    return [reading for reading in ordered if allowed[readings[reading][1]]]


def sees_panels(may: May) -> bool:
    """Whether the viewer may see any panel (the dashboard is 403 otherwise)."""
    return bool(_shown(_panels, may))


def sees_metrics(may: May) -> bool:
    """Whether the viewer may see any metric family (the endpoint is 403 otherwise)."""
    return bool(_shown(_metrics, may))


def panels(now: datetime, using: str, may: May = everything) -> list[Panel]:
    """The panels of the installed apps the viewer may see, in their order."""
    return [panel for make in _shown(_panels, may) for panel in make(now, using)]


def metric_families(now: datetime, using: str, may: May = everything) -> Iterator[Any]:
    """The metric families of the installed apps the viewer may see, in their order."""
    for collect in _shown(_metrics, may):
        yield from collect(now, using)
