"""A server that stops answering with its connections up cannot hold the engine's work.

libpq has no read timeout, and a stopped server's kernel still acknowledges, so keepalives
and tcp_user_timeout never fire: the fault proxy's stall (sockets open, not a byte
relayed) is that server. `leases.watchdog` cuts a unit of work that waits past its
database's LEASES_READ_TIMEOUT, or past the moment the caller said it is worthless (a
lease's renewal after the lease ran out); `leases.db.run` then retries it on a new
connection, which a multi-host URL takes to another server.
"""
from __future__ import annotations

import copy
import logging
import subprocess
import sys
import time

import pytest
from django.conf import settings
from django.db import OperationalError, connection, connections
from django.db.utils import load_backend

import tests.jobs  # noqa: F401 - registers noop
from leases import conf, db
from leases.setup import database_settings
from leases.tasks import push_many
from leases.tasks.models import Job
from tests.conftest import Workers, database_url, wait_for
from tests.faults.test_lease_faults import THREAD_CHILD, pool, through  # noqa: F401 - fixtures
from tests.helpers import Child, drain_and_check

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor == "sqlite", reason="a stalled server: SQLite has none"),
]

CUT = "connection cut, the work is retried on a new one"
BACKEND_ID = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}
SLEEP = {"postgresql": "SELECT pg_sleep(%s)", "mysql": "SELECT SLEEP(%s)"}


@pytest.fixture
def alias():
    """Makes connections from the test database's settings, changed, for this thread only
    (one the test framework does not know is not fenced off by it); closes them at the end."""
    made: list[str] = []

    def make(name: str, **changes) -> str:
        entry = copy.deepcopy(connections["default"].settings_dict)
        options = changes.pop("OPTIONS", {})
        entry.update(changes)
        entry["OPTIONS"].update(options)
        connections[name] = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, alias=name)
        made.append(name)
        return name

    yield make
    for name in made:
        connections[name].close()
        del connections[name]


def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("libpq's multi-host connection strings")


def one(using: str, sql: str, *params) -> object:
    def work(cursor, resumed):
        cursor.execute(sql, params)
        return cursor.fetchone()[0]

    return db.run(work, using)


def cuts(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and CUT in r.getMessage()]


def test_a_unit_through_a_stalled_server_comes_back_through_the_second_host(proxy, alias, caplog):
    postgres_only()
    real = connections["default"].settings_dict
    using = alias("two_hosts", HOST=f"127.0.0.1,{real['HOST'] or '127.0.0.1'}",
                  PORT=f"{proxy.port},{real['PORT'] or 5432}", LEASES_READ_TIMEOUT=2,
                  OPTIONS={"connect_timeout": 2, "target_session_attrs": "read-write"})
    first = one(using, BACKEND_ID["postgresql"])
    assert proxy.stats()["open"] == 1  # the first host, the proxy, took the connection
    proxy.stall()
    began = time.monotonic()
    second = one(using, BACKEND_ID["postgresql"])
    took = time.monotonic() - began
    assert second != first
    assert 1.9 <= took < 10, f"came back after {took:.1f}s"  # the cut at 2 s, a 2 s connect to the proxy
    assert len(cuts(caplog)) == 1, caplog.text
    assert "\n" not in cuts(caplog)[0]


def test_without_a_read_timeout_a_unit_waits_for_the_stall_to_end(proxy, alias, caplog):
    postgres_only()
    using = alias("no_deadline", HOST="127.0.0.1", PORT=proxy.port, LEASES_READ_TIMEOUT=None)
    first = one(using, BACKEND_ID["postgresql"])
    proxy.stall(4)
    began = time.monotonic()
    assert one(using, BACKEND_ID["postgresql"]) == first  # the same connection, never cut
    assert time.monotonic() - began >= 3.5
    assert cuts(caplog) == []


def test_short_work_is_never_cut_and_work_longer_than_the_timeout_is(alias, caplog):
    vendor = connection.vendor
    using = alias("short", LEASES_READ_TIMEOUT=0.5)
    backend = one(using, BACKEND_ID[vendor])
    for _ in range(200):
        one(using, "SELECT 1")
    one(using, SLEEP[vendor], 0.2)
    assert one(using, BACKEND_ID[vendor]) == backend  # no unit was cut: the same session throughout
    assert cuts(caplog) == []
    began = time.monotonic()
    with pytest.raises(OperationalError):
        db.run(lambda cursor, resumed: cursor.execute(SLEEP[vendor], (5,)), using, attempts=2)
    assert time.monotonic() - began < 3  # two attempts, each cut after 0.5 s
    assert len(cuts(caplog)) == 2, caplog.text


def test_a_renewal_is_cut_when_its_lease_runs_out(alias, caplog):
    """MySQL's driver read timeout is longer than this lease: the deadline cuts first."""
    vendor = connection.vendor
    using = alias("renewal", LEASES_READ_TIMEOUT=None, OPTIONS={"read_timeout": 30} if vendor == "mysql" else {})
    began = time.monotonic()
    with pytest.raises(OperationalError):
        db.run(lambda cursor, resumed: cursor.execute(SLEEP[vendor], (10,)), using, until=began + 1.0)
    assert time.monotonic() - began < 3
    assert len(cuts(caplog)) == 1, caplog.text


def test_a_resource_thread_notices_within_its_ttl_that_a_stalled_server_lost_its_lease(pool, proxy, through):  # noqa: F811
    ttl = 3.0
    child = Child([sys.executable, "-c", THREAD_CHILD, str(ttl)], {**through, "LEASES_LOG_LEVEL": "INFO"})
    try:
        assert child.next(30)["event"] == "starting"
        started = child.next(15)
        assert started["event"] == "started"
        time.sleep(1.5)  # renewed twice: the heartbeat's connection is open (a connect waits connect_timeout)
        proxy.stall()
        stalled = time.monotonic()
        wait_for(lambda: "acquiring again" in child.log(), ttl + 2, "the thread to say its lease was lost")
        assert time.monotonic() - stalled <= ttl + 1.0
        lost = [line for line in child.log().splitlines() if "ran out while renewal failed" in line]
        assert len(lost) == 1, child.log()
        proxy.resume()
        wait_for(lambda: "again (token" in child.log(), 30, "the thread to hold a resource again")
        state = child.ask("state")
        assert state["alive"] and state["remaining"] > 0
    finally:
        child.proc.kill()
        child.proc.wait()


def worker_url(port: int, read_timeout: int = 2) -> str:
    """The test database through `port`, with short timeouts."""
    url = database_url().replace(":3306/", f":{port}/").replace(":5432/", f":{port}/")
    extra = "write_timeout=2&" if url.startswith("mysql") else ""
    return f"{url}?{extra}read_timeout={read_timeout}&connect_timeout=2"


def wave(log, start: int, count: int) -> int:
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(start, start + count)])
    return start + count


def succeeded() -> int:
    return Job.objects.filter(status=Job.SUCCEEDED).count()


@pytest.mark.slow
def test_a_worker_through_a_stalled_server_stops_claiming_and_recovers_when_it_wakes(
        proxy, manage, child_env, tmp_path):
    workers = Workers(manage, {**child_env, "DATABASE_URL": worker_url(proxy.port)}, tmp_path)
    log = tmp_path / "runs.log"
    try:
        proc = workers.start("--queue", "default", "--concurrency", "4", "--ttl", "4", "--no-listen")
        total = wave(log, 0, 50)
        wait_for(lambda: succeeded() == total, 60, "the first wave to drain")
        proxy.stall()
        time.sleep(0.5)
        total = wave(log, total, 50)
        time.sleep(8)  # twice the worker's ttl
        assert succeeded() == 50  # nothing claimed through the stalled server
        assert proc.poll() is None, workers.stderr(proc)
        proxy.resume()
        drain_and_check(workers, [proc], log, total, timeout=60)
        stderr = workers.stderr(proc)
        if connection.vendor == "postgresql":  # MySQL's driver times the reads out itself
            assert CUT in stderr, stderr
    finally:
        workers.cleanup()


@pytest.mark.slow
def test_a_worker_with_two_hosts_drains_through_the_second_while_the_first_is_stalled(
        proxy, manage, child_env, tmp_path):
    postgres_only()
    real = connections["default"].settings_dict
    url = worker_url(proxy.port).replace(f"127.0.0.1:{proxy.port}/",
                                         f"127.0.0.1:{proxy.port},{real['HOST'] or '127.0.0.1'}:{real['PORT'] or 5432}/")
    workers = Workers(manage, {**child_env, "DATABASE_URL": url + "&target_session_attrs=read-write"}, tmp_path)
    log = tmp_path / "runs.log"
    try:
        proc = workers.start("--queue", "default", "--concurrency", "4", "--ttl", "10")
        total = wave(log, 0, 50)
        wait_for(lambda: succeeded() == total, 60, "the first wave to drain")
        assert proxy.stats()["open"] >= 1
        proxy.stall()
        total = wave(log, total, 50)
        wait_for(lambda: succeeded() == total, 40, "the second wave to drain while the proxy is stalled")
        assert proc.poll() is None, workers.stderr(proc)
        assert CUT in workers.stderr(proc)
        drain_and_check(workers, [proc], log, total, timeout=60)
    finally:
        workers.cleanup()


# -- settings --------------------------------------------------------------------------------


def test_urls_give_the_read_timeout_and_several_hosts():
    entry = database_settings("postgres://u:p%40ss@db1:5433,db2:5434/name?target_session_attrs=read-write"
                              "&read_timeout=2.5")
    assert (entry["HOST"], entry["PORT"], entry["USER"], entry["PASSWORD"]) == ("db1,db2", "5433,5434", "u", "p@ss")
    assert entry["LEASES_READ_TIMEOUT"] == 2.5 and "read_timeout" not in entry["OPTIONS"]
    assert entry["OPTIONS"]["target_session_attrs"] == "read-write"
    assert entry["OPTIONS"]["keepalives"] == 1 and entry["OPTIONS"]["tcp_user_timeout"] == 30_000
    assert database_settings("postgres://db/name?read_timeout=none")["LEASES_READ_TIMEOUT"] is None
    assert "LEASES_READ_TIMEOUT" not in database_settings("postgres://db/name")  # the default: 30 s
    mysql = database_settings("mysql://u@db:3306/name?read_timeout=7")
    assert mysql["OPTIONS"]["read_timeout"] == 7 and "LEASES_READ_TIMEOUT" not in mysql  # the driver's own
    with pytest.raises(ValueError, match="port 'x' is not a number"):
        database_settings("postgres://u@db:x/name")


@pytest.mark.parametrize("value", ["soon", "-1", True])
def test_a_bad_read_timeout_is_a_check_error(value, monkeypatch):
    monkeypatch.setitem(settings.DATABASES, "bad", {**settings.DATABASES["default"], "LEASES_READ_TIMEOUT": value})
    found = [error for error in conf.check_settings() if error.id == "leases.E016"]
    assert len(found) == 1 and found[0].msg.startswith("DATABASES['bad']: LEASES_READ_TIMEOUT must be None")


@pytest.mark.parametrize("value", ["soon", "-1", "0"])
def test_a_bad_read_timeout_in_the_url_is_one_line_at_check(value, manage, child_env):
    postgres_only()  # MySQL's read_timeout is the driver's
    env = {**child_env, "DATABASE_URL": f"{child_env['DATABASE_URL']}?read_timeout={value}"}
    done = subprocess.run([*manage, "check"], env=env, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if "leases.E016" in line]
    assert len(lines) == 1 and "LEASES_READ_TIMEOUT must be None or seconds" in lines[0], done.stderr
