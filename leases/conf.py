"""Every setting django-leases reads, read and checked here and nowhere else.

Each reader returns the setting's value as the engine uses it (cached until the setting
changes) or raises ValueError with one line. `check_settings`, a system check, runs every
reader at `manage.py check` (and before every command), so a mistake is an error with an
id of its own and a line saying what to change, not a traceback at the first push:

=============  ===========================================================
leases.E001    USE_TZ must be True
leases.E002    LEASES_DATABASE names a database DATABASES lacks
leases.E006    LEASES_ROUTES is malformed or names unknown databases
leases.E007    LEASES_MAX_JSON_BYTES is not a size the engine accepts
leases.E008    LEASES_KEEP_RUNS is not a whole number >= 1
leases.E009    LEASES_HANDLER_GRACE is not a number of seconds
leases.E010    LEASES_SCHEDULES is not a dict of schedules
leases.E011    LEASES_METRICS_TOKEN is not a string
leases.E012    a TASKS entry of this backend has bad QUEUES or OPTIONS
leases.E013    a TASKS BACKEND looks like this backend but cannot be imported
leases.E014    leases.tasks is installed without leases
leases.E015    leases.pipelines is installed without leases.tasks
leases.E016    a DATABASES entry's LEASES_READ_TIMEOUT is not None or seconds > 0
=============  ===========================================================

The database connections themselves are checked by `leases.db` (E003, E004, W001), the
migrations by the commands (E005). This module imports nothing of the engine: every part
of it, the companion apps too, reads its settings from here.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.checks import Error
from django.core.checks.registry import registry
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from .validation import (
    Backoff,
    check_attempts,
    check_backoff,
    check_name,
    check_queue,
    check_seconds,
    check_timeout,
)

#: What a route may name: LEASES_ROUTES's keys.
ROUTE_KINDS = ("pools", "locks", "dispatchers", "queues")
#: The Django Tasks backend of leases.tasks, as TASKS names it.
TASKS_BACKEND = "leases.tasks.backend.DatabaseBackend"
#: Defaults of the settings.
KEEP_RUNS = 100
HANDLER_GRACE = 600.0
MAX_JSON_BYTES = 1 << 20
READ_TIMEOUT = 30.0
#: Keys a schedule of LEASES_SCHEDULES may have.
SCHEDULE_KEYS = frozenset({"handler", "pipeline", "cron", "every", "at", "timezone", "payload", "context", "queue",
                           "priority", "enabled", "catch_up"})

Routes = dict[str, list[tuple[str, bool, str]]]


# -- the readers --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def database() -> str:
    """LEASES_DATABASE: the alias the engine works on unless told otherwise."""
    return getattr(settings, "LEASES_DATABASE", "default")


@lru_cache(maxsize=1)
def routes() -> Routes:
    """LEASES_ROUTES checked: per kind, (name or prefix, is a prefix, alias)."""
    value = getattr(settings, "LEASES_ROUTES", None)
    found = route_problems(value)
    if found:
        raise ValueError(found[0])
    return {kind: [(p.rstrip("*"), p.endswith("*"), alias) for p, alias in (value or {}).get(kind, {}).items()]
            for kind in ROUTE_KINDS}


def routed(kind: str, name: str) -> str | None:
    """The alias a pattern of LEASES_ROUTES sends `name` of `kind` to, or None."""
    for text, prefix, alias in routes()[kind]:
        if name == text or (prefix and name.startswith(text)):
            return alias
    return None


@lru_cache(maxsize=1)
def max_json_bytes() -> int:
    """LEASES_MAX_JSON_BYTES: the largest payload, result or data, as UTF-8 JSON text."""
    value = getattr(settings, "LEASES_MAX_JSON_BYTES", MAX_JSON_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 8 * MAX_JSON_BYTES:
        raise ValueError(f"LEASES_MAX_JSON_BYTES must be a whole number from 1024 to {8 * MAX_JSON_BYTES},"
                         f" not {value!r}")
    return value


@lru_cache(maxsize=1)
def keep_runs() -> int:
    """LEASES_KEEP_RUNS: finished runs kept per job key and per schedule."""
    value = getattr(settings, "LEASES_KEEP_RUNS", KEEP_RUNS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LEASES_KEEP_RUNS must be a whole number >= 1, not {value!r}")
    return value


@lru_cache(maxsize=1)
def handler_grace() -> float:
    """LEASES_HANDLER_GRACE: seconds a job waits for a worker with its handler."""
    return check_seconds(getattr(settings, "LEASES_HANDLER_GRACE", HANDLER_GRACE), "LEASES_HANDLER_GRACE")


@lru_cache(maxsize=1)
def schedules() -> dict[str, dict[str, Any]]:
    """LEASES_SCHEDULES, its shape checked (what each names is checked when it is applied)."""
    value = getattr(settings, "LEASES_SCHEDULES", {}) or {}
    if not isinstance(value, dict):
        raise ValueError("LEASES_SCHEDULES must be a dict of name -> {handler or pipeline, cron/every/at, ...}")
    for name, spec in value.items():
        check_name(name, "LEASES_SCHEDULES: a schedule name", 100)
        if not isinstance(spec, dict):
            raise ValueError(f"LEASES_SCHEDULES[{name!r}] must be a dict")
        unknown = set(spec) - SCHEDULE_KEYS
        if unknown:
            raise ValueError(f"LEASES_SCHEDULES[{name!r}]: unknown key(s) {', '.join(sorted(unknown))}")
        for one_of in (("handler", "pipeline"), ("cron", "every", "at")):
            given = [key for key in one_of if spec.get(key) not in (None, "")]
            if len(given) != 1:
                raise ValueError(f"LEASES_SCHEDULES[{name!r}]: give exactly one of {', '.join(one_of)}"
                                 f" (got {', '.join(given) or 'none'})")
    return value


@lru_cache(maxsize=1)
def metrics_token() -> str:
    """LEASES_METRICS_TOKEN: the bearer token Prometheus scrapes with ('' for none)."""
    value = getattr(settings, "LEASES_METRICS_TOKEN", "") or ""
    if not isinstance(value, str):
        raise ValueError(f"LEASES_METRICS_TOKEN must be a string, not {type(value).__name__}")
    return value


def read_timeout(entry: dict[str, Any], vendor: str) -> float | None:
    """A DATABASES entry's LEASES_READ_TIMEOUT: seconds a unit of the engine's work may
    wait for the server's replies before its connection is cut (None: forever). Default
    READ_TIMEOUT on PostgreSQL, whose driver has no read timeout; None elsewhere (MySQL's
    driver has OPTIONS read_timeout, SQLite no server)."""
    value = entry.get("LEASES_READ_TIMEOUT", READ_TIMEOUT if vendor == "postgresql" else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86400:
        raise ValueError(f"LEASES_READ_TIMEOUT must be None or seconds above 0 and below a day, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class TasksOptions:
    """A TASKS entry of this backend: its queues and its OPTIONS."""

    queues: tuple[str, ...]
    max_attempts: int = 1
    backoff: Backoff = 10.0
    timeout: float | None = None
    #: A database alias; None: where LEASES_ROUTES sends the queues.
    database: str | None = None


def tasks_options(alias: str, params: dict[str, Any]) -> TasksOptions:
    """The checked QUEUES and OPTIONS of TASKS[alias]; ValueError (one line) when wrong."""
    where = f"TASKS[{alias!r}]"
    queues = params.get("QUEUES") or ["default"]
    if isinstance(queues, str) or not isinstance(queues, (list, tuple)):
        raise ValueError(f"{where}['QUEUES'] must be a list of queue names")
    options = dict(params.get("OPTIONS") or {})
    try:
        queues = tuple(check_queue(queue) for queue in queues)
        found = TasksOptions(
            queues=queues,
            max_attempts=check_attempts(options.pop("max_attempts", 1)),
            backoff=check_backoff(options.pop("backoff", 10.0)),
            timeout=check_timeout(options.pop("timeout", None)),
            database=_alias(options.pop("database", None)),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if options:
        raise ValueError(f"{where}['OPTIONS']: unknown option(s) {', '.join(sorted(options))}"
                         " (known: max_attempts, backoff, timeout, database)")
    return found


def tasks_entries() -> dict[str, dict[str, Any]]:
    """The TASKS entries whose BACKEND is this app's, by alias."""
    return {alias: params for alias, params in (getattr(settings, "TASKS", None) or {}).items()
            if isinstance(params, dict) and params.get("BACKEND") == TASKS_BACKEND}


def tasks_queues() -> set[str]:
    """Queue names listed by every TASKS entry of this backend."""
    return {queue for params in tasks_entries().values() for queue in (params.get("QUEUES") or ["default"])}


def _alias(value: Any) -> str | None:
    if value is not None and value not in settings.DATABASES:
        raise ValueError(f"database {value!r} is not in DATABASES ({', '.join(settings.DATABASES)})")
    return value


# -- LEASES_ROUTES ---------------------------------------------------------------------------


def _overlap(a: str, b: str) -> str | None:
    """A name both patterns match, or None."""
    a_prefix, b_prefix = a.endswith("*"), b.endswith("*")
    a_text, b_text = a.rstrip("*") if a_prefix else a, b.rstrip("*") if b_prefix else b
    if a_prefix and b_prefix:
        return max(a_text, b_text, key=len) if a_text.startswith(b_text) or b_text.startswith(a_text) else None
    if a_prefix:
        return b_text if b_text.startswith(a_text) else None
    if b_prefix:
        return a_text if a_text.startswith(b_text) else None
    return a_text if a_text == b_text else None


def route_problems(routes: Any) -> list[str]:
    """What is wrong with a LEASES_ROUTES value, one line each (empty when it is fine)."""
    if routes is None:
        return []
    if not isinstance(routes, dict):
        return [f"LEASES_ROUTES must be a dict of kinds ({', '.join(ROUTE_KINDS)}), not {type(routes).__name__}"]
    found = []
    for kind, patterns in routes.items():
        if kind not in ROUTE_KINDS:
            found.append(f"LEASES_ROUTES: unknown kind {kind!r} (use {', '.join(ROUTE_KINDS)})")
        elif not isinstance(patterns, dict):
            found.append(f"LEASES_ROUTES[{kind!r}] must map name patterns to database aliases")
        else:
            found += _pattern_problems(kind, patterns)
    return found


def _pattern_problems(kind: str, patterns: dict) -> list[str]:
    found = []
    for pattern, alias in patterns.items():
        if not isinstance(pattern, str) or not pattern.rstrip("*") or "*" in pattern.rstrip("*"):
            found.append(f"LEASES_ROUTES[{kind!r}]: pattern {pattern!r} must be a name, or a prefix and one"
                         " trailing *")
        elif alias not in settings.DATABASES:
            found.append(f"LEASES_ROUTES[{kind!r}][{pattern!r}] names {alias!r}, which is not in DATABASES")
    good = [(p, a) for p, a in patterns.items() if isinstance(p, str) and p.rstrip("*")]
    for i, (first, first_alias) in enumerate(good):
        for second, second_alias in good[i + 1 :]:
            both = _overlap(first, second)
            if both is not None and first_alias != second_alias:
                found.append(f"LEASES_ROUTES[{kind!r}]: {first!r} and {second!r} both match {both!r} but name "
                             f"different databases ({first_alias!r}, {second_alias!r})")
    return found


@receiver(setting_changed)
def _forget(setting: str, **kwargs: Any) -> None:
    if setting.startswith("LEASES_") or setting in ("DATABASES", "TASKS"):
        for reader in (database, routes, max_json_bytes, keep_runs, handler_grace, schedules, metrics_token):
            reader.cache_clear()


# -- the system check ---------------------------------------------------------------------


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Every setting of django-leases, each mistake an error with its own id."""
    errors = _installed()
    if not settings.USE_TZ:
        errors.append(Error("django-leases needs USE_TZ = True (it stores and compares UTC).", id="leases.E001"))
    if database() not in settings.DATABASES:
        errors.append(Error(f"LEASES_DATABASE names an unknown database {database()!r}.",
                            hint=f"Name one of DATABASES: {', '.join(settings.DATABASES)}.", id="leases.E002"))
    errors += [Error(problem, id="leases.E006") for problem in route_problems(getattr(settings, "LEASES_ROUTES", None))]
    for reader, code in ((max_json_bytes, "E007"), (keep_runs, "E008"), (handler_grace, "E009"),
                         (schedules, "E010"), (metrics_token, "E011")):
        try:
            reader()
        except ValueError as exc:
            errors.append(Error(str(exc), id=f"leases.{code}"))
    for alias, entry in settings.DATABASES.items():
        try:
            read_timeout(entry, "postgresql")
        except ValueError as exc:
            errors.append(Error(f"DATABASES[{alias!r}]: {exc}", id="leases.E016"))
    return errors + _tasks_errors()


def _installed() -> list[Error]:
    """The companion apps need the apps below them."""
    errors = []
    if apps.is_installed("leases.tasks") and not apps.is_installed("leases"):
        errors.append(Error("leases.tasks is installed without leases, whose leases and locks it runs on.",
                            hint="Add 'leases' to INSTALLED_APPS, before 'leases.tasks'.", id="leases.E014"))
    if apps.is_installed("leases.pipelines") and not apps.is_installed("leases.tasks"):
        errors.append(Error("leases.pipelines is installed without leases.tasks, whose job queue runs its tasks.",
                            hint="Add 'leases' and 'leases.tasks' to INSTALLED_APPS, before 'leases.pipelines'.",
                            id="leases.E015"))
    return errors


def _tasks_errors() -> list[Error]:
    """TASKS entries naming this backend, or a misspelling of it."""
    found = (_tasks_error(alias, params) for alias, params in (getattr(settings, "TASKS", None) or {}).items())
    return [error for error in found if error is not None]


def _tasks_error(alias: str, params: Any) -> Error | None:
    backend = params.get("BACKEND") if isinstance(params, dict) else None
    if backend == TASKS_BACKEND:
        if not apps.is_installed("leases.tasks"):
            return Error(f"TASKS[{alias!r}] uses {TASKS_BACKEND} but leases.tasks is not installed.",
                         hint="Add 'leases' and 'leases.tasks' to INSTALLED_APPS.", id="leases.E012")
        try:
            _tasks_database(alias, tasks_options(alias, params))
        except ValueError as exc:
            return Error(str(exc), id="leases.E012")
    elif isinstance(backend, str) and _looks_like_ours(backend):
        return Error(f"TASKS[{alias!r}]['BACKEND'] = {backend!r} cannot be imported.",
                     hint=f"django-leases' backend is {TASKS_BACKEND!r}.", id="leases.E013")
    return None


def _reported(alias: str, params: Any) -> bool:
    """Whether check_settings reports TASKS[alias]: E012, E013, or E014 (this backend's
    module needs the `leases` app)."""
    ours = isinstance(params, dict) and params.get("BACKEND") == TASKS_BACKEND
    return _tasks_error(alias, params) is not None or (ours and not apps.is_installed("leases"))


def replace_tasks_framework_check() -> None:
    """The Tasks framework's own system check builds every TASKS backend, and building an
    entry that E012 or E013 reports raises (Django 6's InvalidTaskBackend, the backport's
    InvalidTaskBackendError): a traceback from `manage.py check` and every command instead
    of the one line. Swap it for the same check of the other entries only."""
    try:  # Django 6.x
        from django.tasks import checks as framework
        from django.tasks import task_backends
    except ImportError:
        try:  # Django 5.2 with the backport, whether or not it is in INSTALLED_APPS
            from django_tasks import checks as framework
            from django_tasks import task_backends
        except ImportError:
            return  # no Tasks framework: E012 and E013 are all there is

    def check_task_backends(app_configs: Any = None, **kwargs: Any) -> list:
        entries = task_backends.settings
        return [message for alias in entries if not _reported(alias, entries[alias])
                for message in task_backends[alias].check()]

    registry.registered_checks.discard(framework.check_tasks)
    registry.register(check_task_backends)


def _tasks_database(alias: str, options: TasksOptions) -> str:
    """The one database of a TASKS entry's jobs: OPTIONS["database"], else where the routes
    send its queues; ValueError when they go to several (a result id is a job id there)."""
    found = {options.database or routed("queues", name) or database() for name in options.queues}
    if len(found) > 1:
        raise ValueError(f"TASKS[{alias!r}]: its QUEUES are routed to several databases ({', '.join(sorted(found))}):"
                         " give each database a TASKS entry of its own")
    return found.pop()


def tasks_database(alias: str, params: dict[str, Any]) -> tuple[TasksOptions, str]:
    """The checked options of TASKS[alias] and the database its jobs live on."""
    options = tasks_options(alias, params)
    return options, _tasks_database(alias, options)


def _looks_like_ours(backend: str) -> bool:
    """A BACKEND that does not import and is close to this backend's path: a typo."""
    try:
        import_string(backend)
    except ImportError:
        close = difflib.SequenceMatcher(None, backend, TASKS_BACKEND).ratio() >= 0.75
        return close or backend.startswith("leases")
    return False

