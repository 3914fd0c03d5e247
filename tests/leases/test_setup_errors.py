"""A project set up halfway gets one clear line, not a traceback: migrations not applied,
or a MySQL database that does not exist yet (the demo creates it)."""
from __future__ import annotations

import subprocess
import uuid

import pytest
from django.db import connection


def run(manage, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*manage, *args], env=env, capture_output=True, text=True, timeout=120)


def test_commands_say_to_migrate_when_the_tables_are_missing(manage, child_env, tmp_path):
    env = {**child_env, "DATABASE_URL": f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"}
    for argv in (["lease", "list"], ["jobs", "stats"], ["leases_worker", "--burst"]):
        done = run(manage, env, *argv)
        assert done.returncode == 2, done.stderr  # bad input (tests/leases/test_unmigrated.py)
        assert done.stderr.strip().count("\n") == 0, done.stderr  # one line, no traceback
        assert "database 'default' lacks migrations of django-leases (leases.0001_initial," in done.stderr
        assert "Run `python manage.py migrate --database default`. (leases.E005)" in done.stderr

    assert run(manage, env, "migrate", "-v0").returncode == 0
    assert run(manage, env, "migrate", "-v0", "leases_tasks", "0006").returncode == 0  # as before an upgrade
    half = run(manage, env, "jobs", "stats")
    assert half.returncode == 2 and "lacks migrations of django-leases (leases_tasks.0007_status_names," in half.stderr
    assert "leases.0" not in half.stderr  # only what is missing is named

    assert run(manage, env, "migrate", "-v0").returncode == 0
    assert run(manage, env, "lease", "list").returncode == 0
    skipped = run(manage, {**child_env, "DATABASE_URL": env["DATABASE_URL"] + "-other"}, "lease", "list",
                  "--skip-checks")
    assert "lacks migrations" not in skipped.stderr  # --skip-checks skips this one too


@pytest.mark.django_db
def test_createdb_makes_a_missing_mysql_database(manage, child_env):
    if connection.vendor != "mysql":
        pytest.skip("SQLite makes its own file")
    name = f"leases_createdb_{uuid.uuid4().hex[:8]}"
    settings = connection.settings_dict
    url = f"mysql://{settings['USER']}@{settings['HOST'] or '127.0.0.1'}:{settings['PORT'] or 3306}/{name}"
    env = {**child_env, "DATABASE_URL": url}
    try:
        assert "Unknown database" in run(manage, env, "migrate", "-v0").stderr
        made = subprocess.run([*manage[:1], "-m", "project.createdb"], env=env, capture_output=True, text=True)
        assert made.returncode == 0 and f"MySQL database {name} (created if it was missing)" in made.stdout
        assert run(manage, env, "migrate", "-v0").returncode == 0
        again = subprocess.run([*manage[:1], "-m", "project.createdb"], env=env, capture_output=True, text=True)
        assert again.returncode == 0
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")


def refused_urls(url: str) -> list[str]:
    """DATABASE_URLs that the test database's server refuses: a database that does not
    exist and a user it does not know (SQLite: a file in a folder that does not exist)."""
    if url.startswith("sqlite"):
        return ["sqlite:////nonexistent-folder/leases.sqlite3"]
    scheme, rest = url.split("://", 1)
    user, place = rest.split("@", 1)
    return [f"{scheme}://{user}@{place.rsplit('/', 1)[0]}/leases_no_such_database",
            f"{scheme}://nobody-here@{place}"]


@pytest.mark.django_db
def test_a_database_that_refuses_the_connection_is_one_line_and_exit_2(manage, child_env):
    """The commands' migration check re-raised what it did not count as an outage: a
    wrong database name or user was a 70-line traceback and exit 1. Run as operators
    run them, checks included."""
    commands = (["leases_worker", "--burst"], ["jobs", "stats"], ["lease", "list"], ["pipeline", "list"],
                ["schedule", "list"])
    for url in refused_urls(child_env["DATABASE_URL"]):
        for argv in commands:
            done = run(manage, {**child_env, "DATABASE_URL": url}, *argv)
            assert done.returncode == 2, (url, argv, done.stderr)
            assert done.stderr.startswith("CommandError: database 'default' refused the connection: "), done.stderr
            assert done.stderr.strip().count("\n") == 0, done.stderr
