"""Fencing tokens after a failover that lost the last commits.

A PostgreSQL standby promoted in place of a primary that crashed may lack the primary's
last commits: a lease granted there with token N+1 is, on the new primary, still at N.
Granting it again as N+1 would give two holders one token. Every grant therefore writes
at least `db.fence_floor`, which a promotion raises above anything the old timeline
handed out. Here the promotion is simulated by the floor a connection reports; the
Patroni tests (tests/pgha) lose real commits.
"""
from __future__ import annotations

import pytest
from django.db import connection

from leases import Pool, db
from leases.locks import acquire_lock
from leases.models import Lock, Resource
from leases.tasks import Needs, handler, push
from leases.tasks.jobs.claim import CLAIMS_BITS
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

SEEN: list[tuple[str, int]] = []


@handler("fence.fetch", queue="fences", lease=Needs("fence-proxies"))
def fetch(payload, ctx):
    SEEN.append((ctx.lease.name, ctx.lease.token))


@handler("fence.plain", queue="fences")
def plain(payload):
    return payload


@pytest.fixture
def promote(monkeypatch):
    """promote(): from now on the connection is to a server on timeline 3, what the first
    claim after two promotions sees."""

    def promote() -> None:
        monkeypatch.setattr(db, "fence_floor", lambda conn, bits=32: 2 << bits)

    SEEN.clear()
    yield promote
    SEEN.clear()


def test_the_floor_is_zero_on_a_server_that_was_never_promoted():
    connection.ensure_connection()
    assert db.fence_floor(connection) == 0 and db.fence_floor(connection, CLAIMS_BITS) == 0
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(db.dialect(connection).timeline)
            assert cursor.fetchone()[0] == 1  # the test server's own timeline, read as any role may


def test_a_timeline_is_read_once_per_connection(django_assert_num_queries):
    if connection.vendor != "postgresql":
        pytest.skip("only PostgreSQL's standbys can be promoted without the last commits")
    connection.close()
    connection.ensure_connection()
    with django_assert_num_queries(1):
        db.fence_floor(connection)
        db.fence_floor(connection, CLAIMS_BITS)
    connection.close()
    connection.ensure_connection()
    with django_assert_num_queries(1):  # a new session may be on a new server
        db.fence_floor(connection)


def test_a_grant_lost_with_the_old_primary_is_granted_again_under_a_new_token(promote):
    pool = Pool("fence-a")
    pool.add_many([("r1", None)])
    lease = pool.acquire(ttl=30)
    assert lease.token == 1
    # The failover loses that grant: the new primary's row is as it was before it.
    Resource.objects.filter(pool="fence-a").update(token=0, holder="", busy_before=db_now_minus())
    promote()
    again = pool.acquire(ttl=30)
    assert again.token == 2 << 32 and Resource.objects.get(pool="fence-a").token == again.token
    assert again.token != lease.token
    again.renew(ttl=30)  # the new token is the one the row holds: renew and release match it
    again.release()
    later = pool.acquire(ttl=30)
    assert later.token == (2 << 32) + 1  # past the floor, tokens grow by one as before


def test_a_lock_taken_or_made_after_a_failover_starts_above_the_floor(promote):
    promote()
    held = acquire_lock("fence-lock", ttl=30)
    assert held.token == 2 << 32 and Lock.objects.get(name="fence-lock").token == held.token
    Lock.objects.filter(name="fence-lock").update(token=7, expires_at=db_now_minus())
    again = acquire_lock("fence-lock", ttl=30)
    assert again.token == 2 << 32 and Lock.objects.get(name="fence-lock").token == again.token


def test_a_job_claimed_after_a_failover_is_fenced_above_the_floor_and_ends(promote):
    job = push("fence.plain", {"n": 1}, queue="fences")
    promote()
    worker = JobWorker(queues=["fences"], ttl=30)
    worker.register()
    [claimed] = worker.claim(1)
    assert claimed.claims == 2 << CLAIMS_BITS == Job.objects.get(pk=job.pk).claims
    worker.hand_back()
    JobWorker(queues=["fences"], burst=True, poll=0.01).run()
    row = Job.objects.get(pk=job.pk)
    assert row.status == Job.SUCCEEDED and row.claims == (2 << CLAIMS_BITS) + 1  # the outcome matched its fence


def test_a_job_claimed_with_its_lease_after_a_failover_holds_a_token_above_the_floor(promote):
    Pool("fence-proxies").add_many([("p1", None)])
    job = push("fence.fetch", {}, queue="fences")
    promote()
    JobWorker(queues=["fences"], burst=True, poll=0.01).run()
    assert SEEN == [("p1", 2 << 32)]
    assert Job.objects.get(pk=job.pk).lease_token == 2 << 32
    assert Job.objects.get(pk=job.pk).status == Job.SUCCEEDED


def db_now_minus():
    """A moment already past by the database clock: the row reads as free."""
    from datetime import timedelta

    from leases.clock import db_now

    return db_now() - timedelta(seconds=1)
