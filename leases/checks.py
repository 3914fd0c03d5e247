"""System checks for settings the engine's SQL depends on."""
from django.conf import settings
from django.core.checks import Error, Warning, register
from django.db import connections

from . import db


@register()
def check_database(app_configs, **kwargs):
    """The engine compares UTC columns with the server's UTC clock in SQL."""
    errors = []
    if not settings.USE_TZ:
        errors.append(
            Error("django-leases needs USE_TZ = True (it stores and compares UTC).", id="leases.E001")
        )
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
