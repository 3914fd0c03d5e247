"""On PostgreSQL the claim, the acquire and the lookup by key stay index reads on tables
whose statistics are stale: right after a bulk push of 20,000 jobs (or a bulk add of
20,000 resources), before autovacuum or anyone has run ANALYZE. A planner that believed
the tables empty would choose a sequential scan, and every claim would read them whole."""
from __future__ import annotations

import re

import pytest
from django.db import connection, transaction

import tests.jobs  # noqa: F401 - registers noop
from leases import Pool
from leases.sql import statements
from leases.tasks import push_many

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's planner"),
]


def plan(sql: str, params: list) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def analyzed(sql: str, params: list) -> str:
    """The plan as run (rows each step actually read), in a transaction rolled back: the
    claim's FOR UPDATE locks nothing for long."""
    with transaction.atomic():
        shown = plan("ANALYZE " + sql, params)
        transaction.set_rollback(True)
    return shown


@pytest.fixture(autouse=True)
def never_analyzed():
    """The two tables as a new server has them: truncated (the flush between tests only
    deletes, which keeps the statistics of earlier tests' rows), and no autovacuum to
    ANALYZE them during the test."""
    tables = ("leases_tasks_job", "leases_resource")
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {', '.join(tables)} CASCADE")
        for table in tables:
            cursor.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
    yield
    with connection.cursor() as cursor:
        for table in tables:
            cursor.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")


@pytest.fixture
def stale_jobs():
    push_many([("noop", {"n": n}) for n in range(20_000)])  # and no ANALYZE


def test_the_claim_reads_the_claim_index_in_claim_order(stale_jobs):
    """Without the id in the index, each claim read and sorted all 20,000 ready rows (on
    disk: 14 ms a claim, and the drain's rate fell with the backlog)."""
    shown = analyzed(statements(connection, "job").due, ["default", "", 10])
    assert "leases_job_claim" in shown and "Seq Scan" not in shown and "Sort" not in shown, shown
    assert "rows=10 " in shown.split("Index Scan")[1], shown  # it stops after the ten it claims


def test_a_keys_blocked_jobs_are_read_in_claim_order(stale_jobs):
    shown = plan(statements(connection, "limits").next_blocked, ["noop", 10])
    assert "leases_job_limit" in shown and "Sort" not in shown, shown


def test_a_lookup_by_key_reads_an_index(stale_jobs):
    shown = plan(statements(connection, "job").waiting_by_key, ["noop:1"])
    assert "Index" in shown and "Seq Scan" not in shown, shown


def test_the_acquire_reads_the_pool_index():
    Pool("big").add_many([(f"r{n}", None) for n in range(20_000)])
    shown = plan(statements(connection).candidates, ["big", 8])
    assert "Index" in shown and "Seq Scan" not in shown, shown


def test_a_pools_lane_is_read_in_turn_order_and_its_free_slots_through_the_pool_index():
    """Jobs that hold resources: their lane of the claim index, by priority and turn, stops
    after the jobs it reads; a target's free slots are a range of the pool's index with a
    probe of its bans per row, never a read of the whole pool or of every ban."""
    import tests.tasks.test_leased_jobs  # noqa: F401 - registers lease.fetch (pool "proxies")
    from leases import targets

    push_many([("lease.fetch", {"n": n, "site": f"s{n % 50}"}) for n in range(20_000)])
    shown = analyzed(statements(connection, "job").due, ["crawl", "proxies", 10])
    assert "leases_job_claim" in shown and "Seq Scan" not in shown and "Sort" not in shown, shown
    assert "rows=10 " in shown.split("Index Scan")[1], shown
    Pool("proxies").add_many([(f"r{n}", None) for n in range(20_000)])
    for n in range(0, 200, 2):
        targets.ban("proxies", f"r{n}", "s1", 600)
    shown = analyzed(statements(connection, "leasing").free_for, ["proxies", "proxies", "s1", 64])
    assert "leases_resource_free" in shown and "Seq Scan on leases_resource " not in shown, shown


def test_with_statistics_current_a_pools_free_slots_are_read_in_index_order_never_sorted():
    """As a running server keeps its statistics: the longest free slots, ties by id, are
    the index's order, so the claim reads 64 of 20,000 free slots and sorts none; which of
    them the claim's sites refuse is an index read among 10,000 refusals. (A table of a
    hundred refusals is read whole, rightly: CI's planner did so once.)"""
    from datetime import timedelta

    import tests.tasks.test_leased_jobs  # noqa: F401 - registers lease.fetch (pool "proxies")
    from leases import targets
    from leases.clock import db_now
    from leases.models import ResourceTarget

    Pool("proxies").add_many([(f"r{n}", None) for n in range(20_000)])
    for n in range(0, 200, 2):
        targets.ban("proxies", f"r{n}", "s1", 600)
    until = db_now() + timedelta(minutes=10)  # and 10,000 refusals of other sites and pools
    ResourceTarget.objects.bulk_create(
        ResourceTarget(pool=pool, name=f"r{n}", target=f"s{2 + n % 100}", banned_until=until, updated_at=until)
        for pool in ("proxies", "other") for n in range(5_000))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE leases_resource, leases_resourcetarget")
    refused = statements(connection, "leasing").refused + "%s, %s) AND name IN (%s, %s, %s)"
    shown = analyzed(refused, ["proxies", "s1", "s3", "r0", "r1", "r2"])
    assert "Index" in shown and "Seq Scan" not in shown, shown  # probes of a few rows
    for sql, params in [(statements(connection, "leasing").free, ["proxies", 64]),
                        (statements(connection, "leasing").free_for, ["proxies", "proxies", "s1", 64])]:
        shown = analyzed(sql, params)
        assert "Index Scan using leases_resource_free" in shown and "Sort" not in shown, shown
        read = int(re.search(r"actual time=\S+ rows=(\d+)", shown.split("Index Scan")[1]).group(1))
        assert read <= 200, shown  # 64, and those s1 bans among the first (half of them)
