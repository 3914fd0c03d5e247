"""Shared fixtures: real processes against the real test database.

Concurrency is tested with child processes (and subprocesses for the commands), never
threads alone. Tests that start processes use ``django_db(transaction=True)`` so that
what the test writes is committed and visible to the children.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import UserSettingsHolder, settings
from django.core.management import call_command
from django.db import connections
from django.test import TransactionTestCase, override_settings

ROOT = Path(__file__).resolve().parent.parent
#: How the tests start child processes, and make what they share with them (queues, events,
#: locks): forks of a fork server that set Django up once (tests.forkserver), not of the
#: test process, which runs threads (the live server, tqdm's monitor) whose locks a fork
#: would copy mid-way (Python 3.12+ warns of it). A child's target is a module-level function.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["tests.forkserver"])


def _changed_settings() -> dict:
    """The settings this test changed (pytest-django's `settings`, override_settings)."""
    found, holder = {}, settings._wrapped
    while isinstance(holder, UserSettingsHolder):
        for name, value in vars(holder).items():
            if name.isupper():
                found.setdefault(name, value)
        holder = holder.default_settings
    return found


def _child(target, args, kwargs, databases, changed):
    """In the child: the test databases (the fork server read the settings before they
    were made) and the test's settings, then the target."""
    for alias, entry in databases.items():
        if alias in settings.DATABASES:
            settings.DATABASES[alias].update(entry)  # the dicts connections.settings holds too
        else:  # an alias a fixture added while the tests ran (tests.galera's node1, node2)
            connections.settings[alias] = entry
    override_settings(**changed).enable()
    try:
        target(*args, **kwargs)
    finally:
        connections.close_all()


class Processes:
    """Starts child processes; kills whatever is still alive when the test ends."""

    def __init__(self) -> None:
        self.started: list[multiprocessing.Process] = []

    def start(self, target, *args, **kwargs) -> multiprocessing.Process:
        connections.close_all()  # never share a socket with a child
        databases = {alias: dict(connections[alias].settings_dict) for alias in connections}
        proc = CONTEXT.Process(target=_child, args=(target, args, kwargs, databases, _changed_settings()),
                               daemon=True)
        proc.start()
        self.started.append(proc)
        return proc

    def join_all(self, timeout: float = 120) -> None:
        for proc in self.started:
            proc.join(timeout)
            assert not proc.is_alive(), f"process {proc.pid} still running after {timeout}s"

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """Tests make users with passwords; the default hasher is slow on purpose."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def processes():
    procs = Processes()
    yield procs
    procs.cleanup()


@pytest.fixture
def queue():
    return CONTEXT.Queue()


def database_url(alias: str = "default") -> str:
    """A DATABASE_URL naming the test database this session runs on (of `alias`)."""
    s = connections[alias].settings_dict
    if connections[alias].vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    if connections[alias].vendor == "postgresql":
        return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    return f"mysql://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 3306}/{s['NAME']}"


@pytest.fixture
def child_env():
    """Environment for a subprocess (manage.py ...) that must use the test database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "project.settings"  # the demo's, as users run it
    env["DATABASE_URL"] = database_url()
    env["DATABASE_URL_SECOND"] = database_url("second")
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def manage():
    """argv prefix that runs this checkout's manage.py with the current interpreter."""
    return [sys.executable, str(ROOT / "manage.py")]


@pytest.fixture
def fresh_queue_settings():
    """Queue settings are cached per process for a second: start and end each test without."""
    from leases.tasks import queue as jobqueue

    jobqueue.forget_settings()
    yield
    jobqueue.forget_settings()


def start_lease_run(manage: list[str], env: dict, pool: str, options, child: list[str]) -> subprocess.Popen:
    """`manage.py lease run POOL OPTIONS -- CHILD...`, its output in pipes."""
    argv = [*manage, "lease", "run", pool, *options, "--", *child]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    """Whether a process of that id exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: Modules every test worker imports for their handlers (and pipelines).
IMPORTS = ("--import", "tests.jobs", "--import", "tests.jobs_proc", "--import", "tests.pipes")


class Workers:
    """Starts `leases_worker` subprocesses on the test database; kills the leftovers."""

    def __init__(self, manage: list[str], env: dict, tmp_path) -> None:
        self.manage, self.env, self.tmp = manage, env, tmp_path
        self.started: list[subprocess.Popen] = []

    def start(self, *args: str, **env: str) -> subprocess.Popen:
        argv = [*self.manage, "leases_worker", *IMPORTS, *args]
        # A file, not a pipe: a worker that logs much must never block on a full pipe.
        err = open(self.tmp / f"worker-{len(self.started)}.err", "w+")
        proc = subprocess.Popen(argv, env={**self.env, **env}, stdout=subprocess.DEVNULL, stderr=err)
        proc.err = err
        self.started.append(proc)
        return proc

    @staticmethod
    def stderr(proc: subprocess.Popen) -> str:
        proc.err.seek(0)
        return proc.err.read()

    def wait(self, proc: subprocess.Popen, timeout: float = 60) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {proc.pid} still running after {timeout}s:\n{self.stderr(proc)}")

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()  # also ends a SIGSTOPped one
                proc.wait(10)
            proc.err.close()


@pytest.fixture
def workers(manage, child_env, tmp_path):
    procs = Workers(manage, child_env, tmp_path)
    yield procs
    procs.cleanup()


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    """Poll until `predicate()` is truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# -- a faster flush between transactional tests -----------------------------------------
#: Tables a flush keeps: what migrations and post_migrate made, the same for every test.
_KEPT = {"django_migrations", "django_content_type", "auth_permission"}


def _emptied(alias: str) -> bool:
    """Empty `alias`'s tables with DELETE, keeping content types and permissions; False
    where Django's own flush is as quick (SQLite). PostgreSQL's TRUNCATE of every table
    and the post_migrate signal that refills the kept ones cost 0.28 s a test here, the
    DELETEs about 1 ms: a quarter of the suite's time on PostgreSQL."""
    conn = connections[alias]
    if conn.vendor not in ("postgresql", "mysql"):
        return False
    tables = [t for t in conn.introspection.django_table_names(only_existing=True, include_views=False)
              if t not in _KEPT]
    quote = conn.ops.quote_name
    with conn.cursor() as cursor:
        if conn.vendor == "postgresql":  # constraints' triggers off, so the order does not matter
            cursor.execute("SET session_replication_role = replica; "
                           + " ".join(f"DELETE FROM {quote(t)};" for t in tables)
                           + " SET session_replication_role = DEFAULT")
        else:
            cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
            try:
                for table in tables:
                    cursor.execute(f"DELETE FROM {quote(table)}")
            finally:
                cursor.execute("SET FOREIGN_KEY_CHECKS = 1")
    return True


def _fixture_teardown(self) -> None:
    if self.available_apps is not None or self.serialized_rollback:
        return _django_teardown(self)
    for alias in self._databases_names(include_mirrors=False):
        if not _emptied(alias):
            call_command("flush", verbosity=0, interactive=False, database=alias, reset_sequences=False)


_django_teardown = TransactionTestCase._fixture_teardown
TransactionTestCase._fixture_teardown = _fixture_teardown
