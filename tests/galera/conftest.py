"""The three-node Galera cluster of galera/cluster.sh, for the tests of this package.

They run only with LEASES_GALERA=1 (`make test-galera` sets it, starts the cluster, and
points DATABASE_URL at node3, which no test kills or stops); otherwise each is skipped.
The test database (pytest-django's `test_<name>`) is made on node3 and replicated to the
others, so every node and HAProxy serve it: `node_url(n)` and `proxy_url()` name it there.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from django.db import connection, connections

from tests.conftest import ROOT, database_url

ENABLED = os.environ.get("LEASES_GALERA") == "1"
SCRIPT = ROOT / "galera" / "cluster.sh"
PROXY_PORT = 3310
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs the Galera cluster: run `make test-galera` (sets LEASES_GALERA=1)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


#: The databases of a test that uses the aliases "node1" and "node2".
NODES = ["default", "node1", "node2"]


def node_port(n: int) -> int:
    return 3310 + n


def url_at(port: int, **options) -> str:
    """DATABASE_URL of the test database through `port` (a node's, or HAProxy's)."""
    url = re.sub(r":\d+/", f":{port}/", database_url(), count=1)
    query = "&".join(f"{key}={value}" for key, value in options.items())
    return f"{url}?{query}" if query else url


def node_url(n: int, **options) -> str:
    return url_at(node_port(n), **options)


def proxy_url(**options) -> str:
    return url_at(PROXY_PORT, **options)


class Cluster:
    """galera/cluster.sh from the tests: signals to nodes, restarts, the cluster's state."""

    def run(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            pytest.fail(f"cluster.sh {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
        return result.stdout

    def kill(self, n: int) -> None:
        self.run("kill", str(n))

    def stop(self, n: int) -> None:
        self.run("stop", str(n))

    def cont(self, n: int) -> None:
        self.run("cont", str(n))

    def start(self, n: int) -> None:
        self.run("start", str(n))

    def wait_synced(self, seconds: int = 60) -> None:
        self.run("wait-synced", str(seconds), timeout=seconds * 3 + 30)

    def status(self) -> str:
        return self.run("status")

    def heal(self) -> None:
        """Every node running and Synced in one cluster of three, whatever a test left."""
        state = self.status()
        for n in (1, 2, 3):
            line = next(line for line in state.splitlines() if line.startswith(f"node{n} "))
            if "stopped" in line:
                self.cont(n)
            elif "dead" in line:
                self.start(n)
        self.wait_synced()
        # And HAProxy routes to node1 again (it takes three good checks to trust it).
        deadline = time.monotonic() + 20
        while self.through_proxy() != "node1":
            if time.monotonic() > deadline:
                pytest.fail(f"HAProxy does not route to node1:\n{self.status()}")
            time.sleep(0.2)

    def through_proxy(self) -> str:
        """The node a new connection through HAProxy reaches ("" if none)."""
        result = subprocess.run(
            ["mariadb", "--no-defaults", "--protocol=tcp", "-h127.0.0.1", f"-P{PROXY_PORT}", "-uroot",
             "--connect-timeout=2", "-N", "-B", "-e", "SELECT @@wsrep_node_name"],
            capture_output=True, text=True, timeout=30,
        )
        return result.stdout.strip()

    def wsrep(self, n: int, *names: str) -> dict[str, str]:
        """Global wsrep status variables of node `n`, read by the mariadb client."""
        quoted = ", ".join(f"'{name}'" for name in names)
        out = subprocess.run(
            ["mariadb", "--no-defaults", "--protocol=tcp", "-h127.0.0.1", f"-P{node_port(n)}", "-uroot",
             "--connect-timeout=2", "-N", "-B", "-e",
             f"SHOW GLOBAL STATUS WHERE Variable_name IN ({quoted})"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        return dict(line.split("\t", 1) for line in out.splitlines())

    def conflicts(self) -> Counter:
        """Certification failures and brute-force aborts, summed over the nodes."""
        total: Counter = Counter()
        for n in (1, 2, 3):
            found = self.wsrep(n, "wsrep_local_cert_failures", "wsrep_local_bf_aborts")
            total.update({key: int(value) for key, value in found.items()})
        return total


@pytest.fixture(scope="session")
def galera_session(django_db_setup, django_db_blocker):
    """The session's database is a node of a Galera cluster of three (else the tests skip)."""
    with django_db_blocker.unblock():
        if connection.vendor != "mysql":
            pytest.skip("DATABASE_URL must name a node of the Galera cluster (make test-galera)")
        with connection.cursor() as cursor:
            cursor.execute("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'")
            row = cursor.fetchone()
        connections.close_all()
    if row is None or int(row[1]) == 0:
        pytest.skip("DATABASE_URL names no Galera node (make test-galera)")
    # Aliases "node1" and "node2": the test database on those nodes, for tests that talk
    # to two nodes from one process (marked databases=NODES). Mirrors of "default" to the
    # test framework: the same database, never set up or flushed on its own.
    for n in (1, 2):
        conf = copy.deepcopy(connections["default"].settings_dict)
        conf.update(HOST="127.0.0.1", PORT=str(node_port(n)))
        conf["TEST"] = {**conf.get("TEST", {}), "MIRROR": "default"}
        connections.settings[f"node{n}"] = conf


@pytest.fixture
def cluster(galera_session):
    """The cluster, healed before and after each test that uses it."""
    c = Cluster()
    c.heal()
    yield c
    c.heal()


def _count(kinds: Counter, line: str) -> None:
    """Count one leases.db DEBUG line "transient database error (kind), attempt N of M:
    error" by kind, the deadlocks among them (Galera's certification failures are reported as
    1213), and keep the highest attempt number seen ("worst")."""
    found = re.search(r"transient database error \((\w+)\), attempt (\d+) of", line)
    if found:
        kinds[found[1]] += 1
        if "(1213," in line:
            kinds["1213"] += 1
        kinds["worst"] = max(kinds["worst"], int(found[2]))


def merge(counts) -> Counter:
    """Counts of several processes: summed, but for the worst attempt (the highest)."""
    total: Counter = Counter()
    for kinds in counts:
        total.update({key: value for key, value in kinds.items() if key != "worst"})
        total["worst"] = max(total["worst"], kinds.get("worst", 0))
    return +total


class Retries(logging.Handler):
    """The counts of `_count`, from this process's leases.db log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.kinds: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        _count(self.kinds, record.getMessage())


def count_retries() -> Retries:
    """Install a Retries counter on leases.db in this process (a child process); each retry
    is a DEBUG line there."""
    counter = Retries()
    logger = logging.getLogger("leases.db")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(counter)
    return counter


def retries_in(text: str) -> Counter:
    """The same counts from a process's log output."""
    kinds: Counter = Counter()
    for line in text.splitlines():
        _count(kinds, line)
    return kinds
