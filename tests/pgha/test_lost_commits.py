"""What a failover with asynchronous replication loses, and what the product does about it.

The leader's WAL senders are paused (SIGSTOP), so its next commits reach no replica (a
paused WAL receiver would not do: the bytes already in its socket's buffer still arrive);
then the leader dies and a replica takes over without them. Lost: a lease granted, a lock
taken, a job claimed and ended. On the new primary the job is as it was pushed, so it
runs again; the resource and the lock are free, and their next grants carry tokens above
any the old primary handed out (`leases.db.fence_floor`), never the lost ones again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from django.db import connection

from leases import Pool, db
from leases.locks import acquire_lock
from leases.models import Lock, Resource
from leases.tasks import handler, push
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker

from .conftest import SCRIPT

pytestmark = pytest.mark.django_db(transaction=True)

RUNS: list[int] = []


@handler("pgha.lost", queue="pgha-lost")
def counted(payload):
    RUNS.append(payload["n"])


def drain() -> None:
    JobWorker(queues=["pgha-lost"], burst=True, poll=0.01).run()


def new_leader(old: int, timeout: float = 60) -> int:
    """The node that took over from `old`, once HAProxy sends writes to it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = subprocess.run(["bash", str(SCRIPT), "leader"], capture_output=True, text=True, check=False)
        if found.returncode == 0 and found.stdout.strip() not in ("", str(old)):
            try:
                if not db.run(lambda cursor, resumed: read_only(cursor)):
                    return int(found.stdout)
            except Exception:  # noqa: BLE001 - HAProxy may still point at nothing
                pass
        time.sleep(0.5)
    pytest.fail(f"no new leader {timeout}s after node{old} died")


def read_only(cursor) -> bool:
    cursor.execute("SELECT pg_is_in_recovery()")
    return cursor.fetchone()[0]


def senders() -> list[int]:
    """The leader's WAL senders, one per replica (this test runs as root, as the rig does)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_replication")
        return [row[0] for row in cursor.fetchall()]


def test_an_asynchronous_failover_loses_the_last_commits_and_nothing_is_granted_twice(cluster):
    RUNS.clear()
    pool = Pool("pgha-lost")
    pool.add_many([("r1", None)])
    job = push("pgha.lost", {"n": 1}, queue="pgha-lost")
    cluster.wait_healthy()  # all of that is on every replica
    old = cluster.leader()
    paused = senders()
    assert len(paused) == 2
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        lease = pool.acquire(ttl=300)
        lock = acquire_lock("pgha-lost", ttl=300)
        drain()  # the job runs and ends, on the leader alone
        assert RUNS == [1] and Job.objects.get(pk=job.pk).status == Job.SUCCEEDED
    finally:
        assert cluster.kill_leader() == old  # its stopped senders die with it, unsent
    leader = new_leader(old)
    connection.close()

    # Lost: the job's claim and end, the grant, the lock.
    assert Job.objects.get(pk=job.pk).status == Job.READY
    resource = Resource.objects.get(pool="pgha-lost")
    assert resource.holder == "" and resource.token < lease.token
    assert not Lock.objects.filter(name="pgha-lost", token=lock.token).exists()

    # The job runs again; the grants come back with new tokens above the old ones.
    drain()
    assert RUNS == [1, 1] and Job.objects.get(pk=job.pk).status == Job.SUCCEEDED
    again = pool.acquire(ttl=30)
    relock = acquire_lock("pgha-lost", ttl=30)
    assert again.token > lease.token and relock.token > lock.token, (lease.token, again.token, lock.token,
                                                                      relock.token)
    again.release()
    relock.release()
    assert leader != old
