"""Real faults between the lease engine and MySQL/MariaDB, made by tests/faultproxy.py.

A ResourceThread and `manage.py lease` run in child processes whose DATABASE_URL points
at the proxy; the test refuses connections or stalls the proxy and checks what the
children do, and the database rows through its own direct connection.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from leases import Pool
from leases.models import Resource
from tests.conftest import alive, start_lease_run
from tests.helpers import Child

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor == "sqlite", reason="the fault proxy stands in front of a server"),
]

POOL = "faults"
UNAVAILABLE = "CommandError: database unavailable, try again later: "


@pytest.fixture
def pool():
    p = Pool(POOL)
    p.add_many([("a", None), ("b", None)])
    return p


@pytest.fixture
def through(proxy, child_env):
    """child_env with DATABASE_URL naming the test database behind the proxy."""
    scheme = "postgres" if connection.vendor == "postgresql" else "mysql"
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return {**child_env, "DATABASE_URL": f"{scheme}://{auth}@127.0.0.1:{proxy.port}/{s['NAME']}"}


def rows() -> list:
    return list(Resource.objects.order_by("pool", "name").values())


# -- ResourceThread in a child process -----------------------------------------------------

THREAD_CHILD = """
import json, sys, time
import django
django.setup()
from leases import ResourceThread

class Holder(ResourceThread):
    pool = "faults"
    ttl = float(sys.argv[1])
    interval = ttl / 4
    wait_step = 0.5

def say(event, thread=None, **facts):
    if thread is not None:
        lease = thread.lease
        facts.update(alive=thread.is_alive(), name=lease.name, token=lease.token, holder=lease.holder,
                     remaining=lease.remaining())
    print(json.dumps({"event": event, **facts}), flush=True)

thread = Holder()
say("starting")
began = time.monotonic()
thread.start()
say("started", thread, took=time.monotonic() - began)
for command in sys.stdin:
    if command.strip() == "state":
        say("state", thread)
    elif command.strip() == "terminate":
        began = time.monotonic()
        thread.terminate(timeout=1.0)
        say("terminated", took=time.monotonic() - began)
        break
"""





@pytest.fixture
def holder(through):
    """Start the ResourceThread child with a ttl; killed at the end of the test."""
    children: list[Child] = []

    def start(ttl: float) -> Child:
        child = Child([sys.executable, "-c", THREAD_CHILD, str(ttl)], {**through, "LEASES_LOG_LEVEL": "INFO"})
        children.append(child)
        assert child.next(30)["event"] == "starting"
        return child

    yield start
    for child in children:
        child.proc.kill()
        child.proc.wait()


def assert_row_matches(state: dict) -> None:
    row = Resource.objects.get(pool=POOL, name=state["name"])
    assert (row.holder, row.token) == (state["holder"], state["token"])


def test_a_resource_thread_holds_on_through_an_outage_longer_than_its_ttl(pool, proxy, holder):
    ttl = 1.0
    child = holder(ttl)
    first = child.next(15)
    assert first["event"] == "started" and first["remaining"] > 0
    proxy.refuse()
    time.sleep(ttl * 2)
    during = child.ask("state")
    assert during["alive"] and during["remaining"] == 0  # the lost lease says it is not held
    proxy.allow()
    deadline = time.monotonic() + 20
    while True:
        state = child.ask("state")
        if state["remaining"] > 0 and (state["name"], state["token"]) != (first["name"], first["token"]):
            break
        assert time.monotonic() < deadline, f"no live lease again: {state}\n{child.log()}"
        time.sleep(0.2)
    assert state["alive"]
    assert_row_matches(state)
    assert child.ask("terminate")["event"] == "terminated"
    assert child.proc.wait(10) == 0
    log = child.log()
    assert "transient database error" in log  # the refusals were met...
    assert f"holding {POOL}/{state['name']} again (token {state['token']})" in log  # ...and waited out


def test_start_during_an_outage_blocks_until_the_database_is_back(pool, proxy, holder):
    proxy.refuse()
    child = holder(1.0)
    time.sleep(1.0)
    assert child.events.empty(), "start() returned while connections were refused"
    proxy.allow()
    started = child.next(20)
    assert started["event"] == "started" and started["took"] >= 1.0
    assert started["alive"] and started["remaining"] > 0
    assert_row_matches(started)


def test_terminate_returns_within_its_bound_while_the_database_is_stalled(pool, proxy, holder):
    child = holder(2.0)
    assert child.next(15)["event"] == "started"
    proxy.stall()
    time.sleep(0.8)  # longer than the interval: a renewal is stuck in the stalled connection
    began = time.monotonic()
    done = child.ask("terminate")
    assert done["took"] < 2 and time.monotonic() - began < 3
    assert child.proc.wait(10) == 0  # nothing left that waits for the server
    assert "could not release" in child.log()


# -- lease run through the proxy -------------------------------------------------------------

RUN_CHILD = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text(f"{os.getpid()} {time.time()}\\n")
time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[3]))
"""


@pytest.fixture
def lease_run(through, manage, tmp_path):
    """Start `lease run POOL OPTIONS -- python RUN_CHILD MARKER SLEEP CODE`."""
    started: list[subprocess.Popen] = []
    marker = tmp_path / "child"

    def start(*options: str, sleep: float = 0, code: int = 0) -> subprocess.Popen:
        child = [sys.executable, "-c", RUN_CHILD, str(marker), str(sleep), str(code)]
        started.append(start_lease_run(manage, through, POOL, options, child))
        return started[-1]

    start.marker = marker
    yield start
    if marker.exists() and marker.read_text().endswith("\n"):
        pid = int(marker.read_text().split()[0])
        if alive(pid):
            os.kill(pid, 9)
    for proc in started:
        proc.kill()
        proc.communicate()


def child_started(marker: Path, timeout: float = 20) -> tuple[int, float]:
    deadline = time.monotonic() + timeout
    while not (marker.exists() and marker.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    pid, at = marker.read_text().split()
    return int(pid), float(at)


def test_run_waits_out_refused_connections_shorter_than_wait(pool, proxy, lease_run):
    proxy.refuse(2.0)
    refused_at = time.time()
    proc = lease_run("--wait", "30", "--ttl", "5")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    _, ran_at = child_started(lease_run.marker, 0)
    assert ran_at >= refused_at + 2.0  # the command ran only once the database was back


def test_run_exits_75_with_one_line_when_refused_longer_than_wait(pool, proxy, lease_run):
    proxy.refuse()
    proc = lease_run("--wait", "1")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75
    assert stderr.startswith(UNAVAILABLE) and stderr.count("\n") == 1, stderr
    assert not lease_run.marker.exists()


def test_run_keeps_its_commands_exit_code_when_the_release_fails(pool, proxy, lease_run):
    proc = lease_run("--ttl", "4", sleep=1.5, code=7)
    child_started(lease_run.marker)
    proxy.refuse()  # cuts the connections: the release at the end cannot reach the server
    began = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 7, stderr
    assert time.monotonic() - began < 10
    assert f"could not release lease on {POOL}/" in stderr and "Traceback" not in stderr


def test_run_stops_its_command_when_the_lease_runs_out_during_a_stall(pool, proxy, lease_run):
    ttl = 2.0
    proc = lease_run("--ttl", str(ttl), "--grace", "1", sleep=120)
    pid, _ = child_started(lease_run.marker)
    proxy.stall()
    began = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - began
    assert proc.returncode == 75, stderr
    assert took < 3 * ttl, f"exited after {took:.1f}s: it waited for the stalled server"
    assert stderr.splitlines()[-1].startswith(f"CommandError: lease on {POOL}/")
    assert "was lost" in stderr.splitlines()[-1]
    assert not alive(pid)


def test_every_subcommand_exits_75_with_one_line_while_refused(pool, proxy, through, manage, tmp_path):
    file = tmp_path / "more.csv"
    file.write_text("c\n")
    before = rows()
    proxy.refuse()
    commands = [
        ["add", POOL, "c"],
        ["import", POOL, str(file)],
        ["list"],
        ["list", POOL],
        ["remove", POOL, "a"],
        ["release", POOL, "a"],
        ["quarantine", POOL, "a", "--for", "1h"],
        ["unquarantine", POOL, "a"],
        ["stats", POOL],
        ["run", POOL, "--wait", "0", "--", "true"],
    ]
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen([*manage, "lease", *args], env=through, stdout=pipe, stderr=pipe, text=True)
        for args in commands
    ]
    for args, proc in zip(commands, procs):
        out, err = proc.communicate(timeout=90)
        assert (proc.returncode, out) == (75, ""), (args, err)
        assert err.startswith(UNAVAILABLE) and err.count("\n") == 1, (args, err)
    proxy.allow()
    assert rows() == before


# -- a ban whose reply is lost ------------------------------------------------------------


def test_a_quarantine_whose_reply_was_lost_is_found_done(pool, proxy, proxied):
    lease = Pool(POOL, using=proxied).acquire(ttl=30)
    rule = proxy.drop_reply(r"^UPDATE \S+ SET busy_before = .* quarantine_reason = ", count=1)
    lease.quarantine(60, "ban: HTTP 403")  # resent after the lost reply: the row says it was done
    assert rule.dropped == 1
    banned = Resource.objects.get(pool=POOL, name=lease.name)
    assert (banned.quarantine_reason, banned.token, banned.holder) == ("ban: HTTP 403", lease.token + 1, "")
