"""System checks for settings the engine's SQL depends on, and for the migrations its
commands need (checked by the commands themselves: `migrate` runs every registered check,
so a registered one could never let it fix what it reports)."""
import pkgutil
from importlib import import_module

from django.apps import apps
from django.conf import settings
from django.core.checks import Error, Warning, register
from django.db import connections

from . import db, routing

#: The apps of this package whose migrations its commands need.
APP_LABELS = ("leases", "leases_tasks", "leases_pipelines")


@register()
def check_database(app_configs, **kwargs):
    """The engine compares UTC columns with the server's UTC clock in SQL."""
    errors = []
    if not settings.USE_TZ:
        errors.append(
            Error("django-leases needs USE_TZ = True (it stores and compares UTC).", id="leases.E001")
        )
    errors += [Error(problem, id="leases.E006") for problem in routing.problems(getattr(settings, "LEASES_ROUTES", None))]
    alias = db.alias()
    if alias not in connections:
        errors.append(Error(f"LEASES_DATABASE names an unknown database {alias!r}.", id="leases.E002"))
        return errors
    connection = connections[alias]
    if not db.supported(connection.vendor):
        errors.append(
            Error(f"django-leases supports MySQL/MariaDB and SQLite, not {connection.vendor}.", id="leases.E003")
        )
    options = connection.settings_dict.get("OPTIONS") or {}
    if connection.vendor == "mysql" and not options.get("read_timeout"):
        errors.append(
            Warning(
                f"DATABASES[{alias!r}]['OPTIONS'] sets no read_timeout: a stalled database server "
                "hangs workers and heartbeats until it wakes up.",
                hint="Set connect_timeout, read_timeout and write_timeout (e.g. 5, 30, 30 seconds).",
                id="leases.W001",
            )
        )
    if connection.settings_dict.get("TIME_ZONE") not in (None, "UTC"):
        errors.append(
            Error(f"DATABASES[{alias!r}]['TIME_ZONE'] must be unset or 'UTC'.", id="leases.E004")
        )
    return errors


def check_migrated(using: str | None = None) -> list[Error]:
    """An error when migrations of this package's installed apps are not applied to the
    database its engine uses (a missing table reads as a 60-line traceback otherwise).

    One query of `django_migrations` and a listing of the migration files, cheap enough
    for every command run."""
    alias = db.alias(using)
    files = {}
    for label in APP_LABELS:
        if label in apps.app_configs:
            package = import_module(f"{apps.get_app_config(label).name}.migrations")
            files[label] = {name for _, name, is_pkg in pkgutil.iter_modules(package.__path__) if not is_pkg}
    connection = connections[alias]
    with connection.cursor() as cursor:  # an outage raises here, as it would anywhere
        applied = set()
        if "django_migrations" in connection.introspection.table_names(cursor):
            cursor.execute("SELECT app, name FROM django_migrations WHERE app IN (%s, %s, %s)", APP_LABELS)
            applied = set(cursor.fetchall())
    pending = sorted(f"{label}.{name}" for label, names in files.items() for name in names
                     if (label, name) not in applied)
    if not pending:
        return []
    listed = ", ".join(pending[:3]) + (f" and {len(pending) - 3} more" if len(pending) > 3 else "")
    return [Error(f"database {alias!r} lacks migrations of django-leases ({listed}).",
                  hint=f"Run `python manage.py migrate --database {alias}`.", id="leases.E005")]
