"""Bad input exits 2 with one line, for every command of the apps: a database that lacks
the migrations (leases.E005; it was exit 1), and settings the system checks refuse. Run
as operators run them, checks included, on a database of the session's server that no
migration touched."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from django.db import connection

from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)

COMMANDS = (["leases_worker"], ["leases_worker", "--burst", "--queue", "*"], ["lease", "list"], ["jobs", "stats"],
            ["schedule", "list"], ["pipeline", "list"], ["dispatch", "stats", "crawl"], ["leases_prune", "--older-than", "1d"])


def run(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def bare_url(tmp_path):
    """The URL of an empty database on the session's server (SQLite: a new file)."""
    if connection.vendor == "sqlite":
        yield f"sqlite:///{tmp_path / 'bare.sqlite3'}"
        return
    name = connection.settings_dict["NAME"] + "_bare"
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {quote(name)}")
        cursor.execute(f"CREATE DATABASE {quote(name)}")
    try:
        yield database_url().rsplit("/", 1)[0] + "/" + name
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {quote(name)}")


def one_line_e005(done: subprocess.CompletedProcess, argv) -> None:
    assert done.returncode == 2, (argv, done.returncode, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stdout == "", (argv, done.stderr)  # one line, no traceback
    assert "database 'default' lacks migrations of django-leases (leases.0001_initial," in done.stderr, done.stderr
    assert done.stderr.endswith("Run `python manage.py migrate --database default`. (leases.E005)\n"), done.stderr


def test_every_command_on_a_database_without_migrations_is_one_line_and_exit_2(manage, child_env, bare_url):
    env = {**child_env, "DATABASE_URL": bare_url}
    for argv in COMMANDS:
        one_line_e005(run([*manage, *argv], env), argv)
    # The commands without a Django project, on the database of a URL.
    argv = [sys.executable, "-m", "leases", bare_url, "lease", "list"]
    bare = {key: value for key, value in child_env.items() if key not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")}
    one_line_e005(run(argv, bare), argv)


def test_settings_the_checks_refuse_exit_2_from_the_apps_commands(manage, child_env, tmp_path):
    (tmp_path / "bad_settings.py").write_text("from project.settings import *  # noqa\n" + textwrap.dedent(
        'LEASES_MAX_JSON_BYTES = "big"\n'))
    env = {**child_env, "DJANGO_SETTINGS_MODULE": "bad_settings", "PYTHONPATH": f"{tmp_path}:{child_env['PYTHONPATH']}"}
    for argv in (["jobs", "stats"], ["leases_worker", "--burst"]):
        done = run([*manage, *argv], env)
        assert done.returncode == 2 and "(leases.E007)" in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr
