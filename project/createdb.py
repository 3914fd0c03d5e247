"""`python -m project.createdb`: create the databases the settings configure, if missing:
DATABASE_URL's, and the second one when the settings configure it (DATABASE_URL_SECOND,
or LEASES_ROUTES naming it).

`make demo` and the benches run it first, so a MySQL/MariaDB or PostgreSQL URL naming a
database that does not exist yet works instead of failing with "Unknown database". SQLite
creates its file itself; only its folder is made here.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

#: Database names this creates: what needs no quoting beyond backticks.
SAFE_NAME = re.compile(r"[A-Za-z0-9_$]{1,64}")


def create_database(alias: str = "default") -> str:
    """Create the database of `alias` unless it exists; returns a line saying what it did.
    Call it after settings are configured and before Django first connects to it."""
    from django.db import connections

    connection = connections[alias]
    name = connection.settings_dict["NAME"]
    if connection.vendor == "sqlite":
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        return f"SQLite database {name}"
    if connection.vendor not in ("mysql", "postgresql"):
        return f"{connection.vendor} database {name} (create it yourself)"
    if not SAFE_NAME.fullmatch(name):  # an identifier cannot be a parameter: only plain names
        raise SystemExit(f"cannot create database {name!r}: use letters, digits, _ and $ only")
    if connection.vendor == "postgresql":
        return _create_postgres(connection, name)
    import MySQLdb

    params = connection.get_connection_params()
    params.pop("database", None)
    params.pop("db", None)
    server = MySQLdb.connect(**params)
    try:
        server.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
    finally:
        server.close()
    return f"MySQL database {name} (created if it was missing)"


def _create_postgres(connection, name: str) -> str:
    """CREATE DATABASE has no IF NOT EXISTS on PostgreSQL and cannot run in a transaction:
    ask the server's own `postgres` database whether it exists, then create it."""
    import psycopg

    params = {**connection.get_connection_params(), "dbname": "postgres"}
    with psycopg.connect(**params, autocommit=True) as server:
        if server.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            server.execute(f'CREATE DATABASE "{name}"')
    return f"PostgreSQL database {name} (created if it was missing)"


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.db import connections

    for alias in connections:
        print(create_database(alias))
