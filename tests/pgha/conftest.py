"""The Patroni cluster of pgha/cluster.sh, for the tests of this package.

They run only with LEASES_PGHA=1 (`make test-pg-ha` sets it, starts the cluster, and
points DATABASE_URL at HAProxy, which routes to the leader); otherwise each is skipped.
The test database (pytest-django's `test_<name>`) is made through HAProxy on the leader
and replicated to the others, so it survives every failover the tests cause.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from django.db import connection, connections

from tests.conftest import ROOT, database_url

ENABLED = os.environ.get("LEASES_PGHA") == "1"
SCRIPT = ROOT / "pgha" / "cluster.sh"
HERE = Path(__file__).resolve().parent
NODE_PORTS = (5441, 5442, 5443)


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs the Patroni cluster: run `make test-pg-ha` (sets LEASES_PGHA=1)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def multi_host_url() -> str:
    """DATABASE_URL of the test database as libpq's list of the three nodes: a new
    connection tries each in turn and keeps the one that takes writes."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in NODE_PORTS)
    url = re.sub(r"@[^/]+/", f"@{hosts}/", database_url(), count=1)
    return f"{url}?target_session_attrs=read-write"


class Cluster:
    """pgha/cluster.sh from the tests: kills, restarts, switchovers, the cluster's state."""

    def run(self, *args: str, timeout: float = 180) -> str:
        result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False, timeout=timeout)
        if result.returncode != 0:
            pytest.fail(f"cluster.sh {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result.stdout

    def leader(self) -> int:
        return int(self.run("leader").strip())

    def kill_leader(self) -> int:
        """SIGKILL the leader's Patroni and PostgreSQL at once; returns its number."""
        return int(self.run("kill-leader").strip())

    def switchover(self) -> int:
        """patronictl switchover to a replica; returns the new leader's number."""
        return int(self.run("switchover").strip())

    def begin(self, *args: str) -> subprocess.Popen:
        """cluster.sh ARGS in the background, for a test that goes on meanwhile; its output
        in a file (the servers it starts must not hold a pipe of the test's)."""
        out = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(["bash", str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT, text=True)
        proc.out = out
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = 180) -> str:
        proc.wait(timeout)
        proc.out.seek(0)
        out = proc.out.read()
        proc.out.close()
        if proc.returncode != 0:
            pytest.fail(f"cluster.sh {' '.join(proc.args[2:])} failed:\n{out}")
        return out

    def start(self, n: int) -> None:
        """Start node N again; through a file, as the servers it starts keep its output open."""
        self.finish(self.begin("start", str(n)))

    def mode(self, mode: str) -> None:
        self.run("mode", mode)

    def wait_healthy(self, seconds: int = 90) -> None:
        self.run("wait-healthy", str(seconds), timeout=seconds + 60)

    def status(self) -> str:
        return self.run("status")

    def heal(self) -> None:
        """Every node running, one leader, two streaming replicas, HAProxy on the leader,
        asynchronous replication: whatever a test left."""
        for line in self.status().splitlines():
            found = re.match(r"node(\d)  patroni dead", line)
            if found:
                self.start(int(found[1]))
        self.wait_healthy()
        self.mode("async")


@pytest.fixture(scope="session")
def pgha_session(django_db_setup, django_db_blocker):
    """The session's database is reached through HAProxy in front of Patroni (else skip)."""
    with django_db_blocker.unblock():
        if connection.vendor != "postgresql":
            pytest.skip("DATABASE_URL must name the Patroni cluster's HAProxy (make test-pg-ha)")
        with connection.cursor() as cursor:
            cursor.execute("SELECT inet_server_port()")
            port = cursor.fetchone()[0]
        connections.close_all()
    if port not in NODE_PORTS:
        pytest.skip("DATABASE_URL does not reach a node of the Patroni cluster (make test-pg-ha)")


@pytest.fixture
def cluster(pgha_session):
    """The cluster, healed before and after each test that uses it."""
    c = Cluster()
    c.heal()
    yield c
    c.heal()
