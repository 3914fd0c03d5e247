"""Django Tasks used by the backend tests; workers load them with ``--import tests.tasks_demo``."""
from __future__ import annotations

from leases.tasks.backend import Task  # noqa: F401 - the framework in use (django.tasks or the backport)

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task(priority=10)
def urgent(tag: str) -> str:
    return tag


@task()
def explode(n: int) -> None:
    raise ValueError(f"exploded {n}")


@task(takes_context=True)
def which_attempt(context, fail_until: int) -> int:
    if context.attempt < fail_until:
        raise RuntimeError(f"attempt {context.attempt}")
    return context.attempt


@task()
async def async_add(a: int, b: int) -> int:
    return a + b
