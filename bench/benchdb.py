"""What the benches share: their own database, made before Django first connects, a raw
DB-API connection set up as Django sets up its own (for the raw-SQL baselines), and how
they name the server they ran on.

Import it after DATABASE_URL names the bench's database and before ``django.setup()``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings

from project.createdb import create_database


def databases(name: str) -> dict[str, str]:
    """The bench `name`'s own databases, never the project's: it fills and empties tables."""
    return {"mariadb": f"mysql://root@127.0.0.1:3306/bench_{name}", "sqlite": f"sqlite:////tmp/bench_{name}/db.sqlite3",
            "postgres": f"postgres://postgres@127.0.0.1:5432/bench_{name}"}


def setup(name: str, choice: str | None) -> None:
    """Point DATABASE_URL at the bench's database (`choice`: mariadb, postgres, sqlite or a URL;
    None for mariadb), create it if missing, and set Django up."""
    import django

    known = databases(name)
    os.environ["DATABASE_URL"] = known.get(choice or "mariadb", choice or "")
    create_database()
    django.setup()


def raw_connect(with_db: bool = True) -> Any:
    """A DB-API connection in autocommit, set up like Django's own (isolation, WAL)."""
    cfg = settings.DATABASES["default"]
    if cfg["ENGINE"].endswith("sqlite3"):
        import sqlite3

        options = cfg.get("OPTIONS", {})
        conn = sqlite3.connect(cfg["NAME"], timeout=options.get("timeout", 30), isolation_level=None)
        for command in options.get("init_command", "").split(";"):
            if command.strip():
                conn.execute(command)
        return conn
    import MySQLdb
    from MySQLdb.constants import CLIENT

    kwargs: dict[str, Any] = {"user": cfg["USER"], "charset": "utf8mb4", "autocommit": True,
                              "client_flag": CLIENT.FOUND_ROWS}
    if with_db:
        kwargs["db"] = cfg["NAME"]
    if cfg.get("PASSWORD"):
        kwargs["password"] = cfg["PASSWORD"]
    host = cfg.get("HOST") or "127.0.0.1"
    kwargs["unix_socket" if host.startswith("/") else "host"] = host
    if cfg.get("PORT"):
        kwargs["port"] = int(cfg["PORT"])
    conn = MySQLdb.connect(**kwargs)
    conn.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")  # Django's default
    return conn


def database_version(flush: bool = True) -> str:
    """"MariaDB 10.11.19-..." or "PostgreSQL 15.19 ...", with its commit policy (a log
    flush per commit or not)."""
    from django.db import connections

    conn = connections["default"]
    if conn.vendor == "sqlite":
        import sqlite3

        return f"SQLite {sqlite3.sqlite_version}"
    if conn.vendor == "postgresql":
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('server_version'), current_setting('synchronous_commit')")
            version, policy = cur.fetchone()
        return f"PostgreSQL {version}, synchronous_commit={policy}" if flush else f"PostgreSQL {version}"
    with conn.cursor() as cur:
        cur.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit")
        version, policy = cur.fetchone()
    server = f"{'MariaDB' if conn.mysql_is_mariadb else 'MySQL'} {version}"
    return f"{server}, innodb_flush_log_at_trx_commit={policy}" if flush else server


def peer_python(name: str) -> Path:
    """The interpreter of the peer `name` (procrastinate, celery): its own environment,
    bench/.peers/<name>, made on first use and brought up to date when
    requirements-<name>.txt changes, so the project's venv never holds a peer."""
    root = Path(__file__).resolve().parent
    env, requirements = root / ".peers" / name, root.parent / f"requirements-{name}.txt"
    python, installed = env / "bin" / "python", env / requirements.name
    wanted = requirements.read_text()
    if not python.exists() or not installed.exists() or installed.read_text() != wanted:
        print(f"installing {requirements.name} in {env}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True)
        installed.write_text(wanted)
    return python
