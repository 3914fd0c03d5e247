"""Clients while the leader's PostgreSQL is stopped (SIGSTOP: a hung server whose sockets
stay open), for longer than the holders' ttl and than Patroni's failover, then continued.

The clients of tests.pgha.test_failover (two `leases_worker` processes draining a queue
with pipelines and a schedule, three ResourceThread holders and an AsyncHolder with a 3 s
ttl, a `lease run`, a writer) reach the cluster with a read deadline of READ_TIMEOUT
seconds (`?read_timeout=` in their DATABASE_URL). A stopped server answers nothing and
closes nothing, so only that deadline, a lease's own deadline and HAProxy's check end
their waits. Each holder must say in one line that its lease ran out, within its ttl;
the drain must finish through the new primary while the old one is still stopped; once
continued, the old primary must demote itself and rejoin as a replica. No job lost or
left running, no lease held twice (by token), no client dead.
"""
from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime

import pytest
from django.db import InterfaceError, OperationalError

from leases import db
from leases.models import Resource
from tests.conftest import database_url
from tests.galera.test_failover import summary
from tests.pgha import test_failover as failover
from tests.pgha.conftest import NODE_PORTS, SCRIPT, Cluster, multi_host_url
from tests.pgha.test_failover import clients  # noqa: F401 - the fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(480),
              pytest.mark.usefixtures("fresh_queue_settings")]

#: The clients' read deadline: a unit of work waiting longer on the stopped server is cut
#: and retried on a new connection (30 s by default on PostgreSQL).
READ_TIMEOUT = 5
#: The node stays stopped at least this long (Patroni's leader key ttl is 8 s) and until
#: the drain is done, at most STOPPED_AT_MOST.
STOPPED_AT_LEAST, STOPPED_AT_MOST = 20.0, 120.0
#: Generous bounds: a holder's renewal is cut at its lease's deadline, so the line comes
#: within the ttl of the last renewal; a failover takes 8 to 11 s, plus a read deadline.
NOTICED_WITHIN = failover.HOLDER_TTL + 1.5
CARRY_ON_WITHIN = 30.0
LONGEST_GAP = 30.0
#: A woken leader finds another one holds the leader key and demotes itself.
DEMOTED_WITHIN = 150.0

RAN_OUT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING leases[.\w]*: .* ran out while renewal failed",
                     re.MULTILINE)


def briefly(read, default=None):
    """A read of the test's own through HAProxy, cut after 2 s: `default` meanwhile (the
    test's connection may be on the stopped server)."""
    try:
        return db.run(lambda cursor, resumed: read(), attempts=1, until=time.monotonic() + 2.0)
    except (OperationalError, InterfaceError):
        return default


def leader_now() -> int | None:
    """The leader by Patroni's REST API (None while there is none)."""
    found = subprocess.run(["bash", str(SCRIPT), "leader"], capture_output=True, text=True, check=False, timeout=30)
    return int(found.stdout) if found.returncode == 0 else None


def haproxy_view() -> dict[str, str]:
    """{node: UP or DOWN} as HAProxy's checks of Patroni's GET /primary have it."""
    return dict(re.findall(r"^  (node\d) (\w+),", Cluster().status(), re.MULTILINE))


def stall(cluster: Cluster, old: int) -> dict[str, float]:
    """SIGSTOP the leader's PostgreSQL until the drain is done (at least STOPPED_AT_LEAST),
    then SIGCONT it and wait until it is a running replica. Returns when each step
    happened (time.time()) and the lease run's renewals as this test saw them."""
    cluster.run("stop", str(old))
    at = {"stopped": time.time()}
    renewals: dict[float, float] = {}
    try:
        while time.time() - at["stopped"] < STOPPED_AT_MOST:
            row = briefly(lambda: Resource.objects.filter(pool=failover.RUN_POOL)
                          .values_list("renewed_at", flat=True).first())
            if row is not None:
                renewals.setdefault(row.timestamp(), time.time())
            if "moved" not in at and leader_now() not in (None, old):
                at["moved"] = time.time()
            if "routed" not in at and haproxy_view().get(f"node{old}") == "DOWN":
                at["routed"] = time.time()
            if "drained" not in at and briefly(failover.done, False):
                at["drained"] = time.time()
            if "drained" in at and "moved" in at and time.time() - at["stopped"] >= STOPPED_AT_LEAST:
                break
            time.sleep(0.2)
    finally:
        cluster.run("cont", str(old))
        at["continued"] = time.time()
    at["renewals"] = renewals
    deadline = time.monotonic() + DEMOTED_WITHIN
    while time.monotonic() < deadline:
        if "demoted" not in at and not still_primary(old):
            at["demoted"] = time.time()
        if re.search(rf"^node{old}  (replica|sync_standby) +running", cluster.status(), re.MULTILINE):
            at.setdefault("demoted", time.time())
            at["rejoined"] = time.time()
            break
        time.sleep(0.2)
    assert "rejoined" in at, f"node{old} did not rejoin as a replica within {DEMOTED_WITHIN:g}s of SIGCONT"
    cluster.wait_healthy()
    time.sleep(1.0)  # and the clients go on with the old leader back as a replica
    return at


def still_primary(n: int) -> bool:
    """Whether node `n` takes writes: a woken leader does until it demotes itself."""
    import psycopg  # only where the cluster runs: the suite's other databases need no driver

    try:
        with psycopg.connect(host="127.0.0.1", port=NODE_PORTS[n - 1], user="postgres", dbname="postgres",
                             connect_timeout=2) as conn:
            return not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
    except psycopg.Error:
        return False


def losses(text: str) -> list[float]:
    """When a holder's log said its lease ran out while the renewal failed."""
    return [datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() for stamp in RAN_OUT.findall(text)]


@pytest.mark.parametrize("route", ["haproxy", "multi-host"])
def test_a_stopped_leader_holds_no_client(cluster, clients, manage, tmp_path, capsys, route):  # noqa: F811
    base = database_url() + "?" if route == "haproxy" else multi_host_url() + "&"
    url = f"{base}read_timeout={READ_TIMEOUT}"
    logs = {name: tmp_path / f"{name}.log" for name in ("jobs", "pipelines", "ticks")}
    # A worker's heartbeat waits out the stall's read deadline, the failover and, through a
    # host list, a connect timeout on the stopped node: up to about 20 s.
    found = failover.start_clients(clients, manage, url, logs, worker_ttl=40.0)
    failover.warm_up()
    old = cluster.leader()
    at = stall(cluster, old)
    seen = failover.stop_clients(clients, found)

    assert "drained" in at, f"the drain did not finish while node{old} was stopped"
    assert "moved" in at, f"no other node took over while node{old} was stopped"
    facts = {"ran twice": failover.check_jobs(logs, may_repeat=True)}  # asynchronous: the stop may lose commits
    failover.check_pipelines(logs, may_repeat=True)
    facts["ticks"] = failover.check_ticks(logs, may_repeat=True)
    failover.check_leases([*seen["holders"], seen["async"]])
    facts["acknowledged commits lost"] = failover.lost_commits(seen["writer"])
    facts["leader"] = f"node{old} -> node{cluster.leader()}"

    noticed = [[t - at["stopped"] for t in losses(child.log())] for child in [*found["holders"], found["async"]]]
    since = {step: at[step] - at["stopped"] for step in ("moved", "routed", "drained", "continued") if step in at}
    measured = failover.measure(at["stopped"], seen, at["renewals"])
    lines = failover.report(f"SIGSTOP the leader's PostgreSQL, clients via {route} with read_timeout={READ_TIMEOUT}",
                   measured, seen, facts)
    lines.append("  after the stop: " + ", ".join(f"{step} {t:.1f}s" for step, t in since.items())
                 + f"; after SIGCONT the old leader took writes until {at['demoted'] - at['continued']:.1f}s,"
                 f" a running replica at {at['rejoined'] - at['continued']:.1f}s")
    lines.append(f"  holders said their lease ran out: {summary([t for ts in noticed for t in ts])} after the stop;"
                 f" lines per holder {[len(ts) for ts in noticed]}")
    with capsys.disabled():
        print("\n[pgha] " + "\n".join(lines))

    warned = [line for child in [*found["holders"], found["async"]] for line in child.log().splitlines()
              if " WARNING " in line]
    for ts in noticed:  # one line per holder, within its ttl
        assert len(ts) == 1 and 0 < ts[0] < NOTICED_WITHIN, (noticed, lines, warned)
    assert at["drained"] < at["continued"], lines
    for kind, values in measured.items():
        for first, gap in values:
            assert first is not None and first < CARRY_ON_WITHIN, (kind, values, lines)
            assert gap < LONGEST_GAP, (kind, values, lines)
    assert at["rejoined"] - at["continued"] < DEMOTED_WITHIN, lines
