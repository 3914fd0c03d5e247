"""A project with one database works: the demo settings configure `second` only when
DATABASE_URL_SECOND or LEASES_ROUTES asks for it, since Django 6.1's checks connect to every
configured database and `manage.py check` died on a `second` nobody had created."""
from __future__ import annotations

import json
import subprocess
import uuid

import pytest
from django.db import connection

from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def run(manage, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*manage, *args], env=env, capture_output=True, text=True, check=False, timeout=180)


def databases(manage, env) -> list[str]:
    code = "import json; from django.conf import settings; print(json.dumps(sorted(settings.DATABASES)))"
    shown = run(manage, env, "shell", "-v0", "-c", code)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


@pytest.fixture
def only_default(child_env, tmp_path):
    """child_env on a database of its own whose `<name>_second` does not exist."""
    env = {k: v for k, v in child_env.items() if k != "DATABASE_URL_SECOND"}
    if connection.vendor == "sqlite":
        env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'one.sqlite3'}"
        yield env
        return
    name = f"leases_one_{uuid.uuid4().hex[:8]}"
    env["DATABASE_URL"] = database_url().rsplit("/", 1)[0] + "/" + name
    try:
        yield env
    finally:
        quote = "`" if connection.vendor == "mysql" else '"'
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {quote}{name}{quote}")


def test_commands_run_on_one_database_when_nothing_names_a_second(manage, only_default, tmp_path):
    made = run(manage[:1], only_default, "-m", "project.createdb")
    assert made.returncode == 0 and made.stdout.count("\n") == 1, made.stdout + made.stderr  # default only
    assert databases(manage, only_default) == ["default"]
    for argv in (["migrate", "-v0"], ["check"], ["leases_worker", "--burst"]):
        done = run(manage, only_default, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    assert not (tmp_path / "one-second.sqlite3").exists()  # SQLite: never even opened


def test_a_route_to_second_or_its_url_configures_it(manage, child_env):
    without = {k: v for k, v in child_env.items() if k != "DATABASE_URL_SECOND"}
    routed = {**without, "LEASES_ROUTES": json.dumps({"queues": {"crawl*": "second"}})}
    assert databases(manage, routed) == ["default", "second"]
    assert databases(manage, child_env) == ["default", "second"]
