"""Pools with manners: slots (several holders, each with its own lease), cool-down after a
release, fair waiting in arrival order, and candidates that cost the same however large
the pool. Concurrency claims with child processes."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from django.db import connection

from leases import LeaseLost, NoResourceAvailable, Pool
from leases.models import Resource, Waiter
from leases.pool import CANDIDATES, TICKET_TTL
from leases.sql import statements

pytestmark = pytest.mark.django_db(transaction=True)


# -- which slot a caller gets -----------------------------------------------------------


def test_the_slot_free_longest_is_handed_out_first_and_a_released_one_rests_at_the_back():
    pool = Pool("lru")
    pool.add_many([(f"r{i:02d}", None) for i in range(CANDIDATES + 4)])
    last = None
    for _ in range(40):
        lease = pool.acquire(ttl=30)
        assert lease.name != last  # the one just released is the newest free: never a candidate
        lease.release()
        last = lease.name
        time.sleep(0.002)  # past the clock's resolution (SQLite: 1 ms), so releases do not tie


def test_candidates_are_an_index_range_read_of_a_few_rows_however_large_the_pool():
    if connection.vendor != "mysql":
        pytest.skip("ANALYZE checked on MySQL/MariaDB")
    Pool("big").add_many((f"r{i}", None) for i in range(20_000))
    Pool("other").add_many((f"r{i}", None) for i in range(5_000))
    sql = statements(connection).candidates.replace("%s", "'big'", 1).replace("%s", str(CANDIDATES))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE FORMAT=JSON " + sql)
        plan = cursor.fetchone()[0]
    [step] = json.loads(plan)["query_block"]["nested_loop"]
    table = step["table"]
    assert table["key"] == "leases_resource_free" and table["access_type"] in ("range", "ref"), table
    assert table["r_rows"] <= CANDIDATES, table  # the rows actually read
    assert "filesort" not in plan


def test_a_targets_candidates_probe_its_refusals_never_read_every_pools():
    """An acquirer for a target (the Scrapy middleware's): its refusals are probed per slot
    or read for its pool and target only, however many other pools and targets refuse."""
    from datetime import timedelta

    from leases.clock import db_now
    from leases.models import ResourceTarget

    if connection.vendor != "mysql":
        pytest.skip("ANALYZE checked on MySQL/MariaDB")
    Pool("big").add_many((f"r{i}", None) for i in range(5_000))
    until = db_now() + timedelta(minutes=10)
    ResourceTarget.objects.bulk_create(
        ResourceTarget(pool=pool, name=f"r{i}", target=f"s{i % 50}", banned_until=until, updated_at=until)
        for pool in ("big", "other") for i in range(0, 5_000, 2))
    sql = statements(connection).candidates_for
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_resource, leases_resourcetarget")
        cursor.fetchall()
        cursor.execute("ANALYZE FORMAT=JSON " + sql, ["big", "big", "s1", CANDIDATES])
        plan = json.loads(cursor.fetchone()[0])
    read = []

    def tables(node):
        if isinstance(node, dict):
            if "table_name" in node:
                read.append(node)
            for value in node.values():
                tables(value)
        elif isinstance(node, list):
            for value in node:
                tables(value)

    tables(plan)
    refusals = [table for table in read if table["table_name"] == "g"]
    assert refusals and all(table["access_type"] != "ALL" for table in read), read
    assert sum(table.get("r_rows", 0) * table.get("r_loops", 1) for table in refusals) <= 200, refusals


# -- slots ------------------------------------------------------------------------------


def test_a_resource_with_slots_has_that_many_holders_each_with_its_own_token():
    pool = Pool("accounts")
    assert pool.add("acct-7", {"user": "seven"}, slots=3) is True
    leases = [pool.acquire(ttl=30) for _ in range(3)]
    assert {lease.name for lease in leases} == {"acct-7"} and sorted(lease.slot for lease in leases) == [0, 1, 2]
    assert len({(lease.slot, lease.token) for lease in leases}) == 3
    assert all(lease.resource == {"user": "seven"} for lease in leases)
    with pytest.raises(NoResourceAvailable):
        pool.acquire(ttl=30)
    assert pool.stats() == {"free": 0, "held": 3, "cooling": 0, "quarantined": 0, "total": 3}
    leases[0].release()
    assert pool.stats()["free"] == 1
    # Fewer slots: the highest go, and their holders lose them at the next renewal.
    assert pool.add("acct-7", {"user": "7"}, slots=2) is False
    lost = next(lease for lease in leases if lease.slot == 2)
    with pytest.raises(LeaseLost):
        lost.renew()
    assert list(Resource.objects.filter(name="acct-7").values_list("slot", "data")) == [(0, {"user": "7"}),
                                                                                      (1, {"user": "7"})]
    pool.quarantine("acct-7", 60, "banned")  # the resource, every slot of it
    assert pool.stats() == {"free": 0, "held": 0, "cooling": 0, "quarantined": 2, "total": 2}
    assert pool.remove("acct-7") is True and not Resource.objects.exists()


def _hold_slots(pool_name: str, seconds: float, out) -> None:
    """Lease and release slots, reporting each use's window while surely held."""
    pool = Pool(pool_name)
    uses = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            lease = pool.acquire(ttl=10, wait=1)
        except NoResourceAvailable:
            continue
        began = time.monotonic()
        time.sleep(0.01)
        if lease.remaining() > 0:
            uses.append((lease.slot, lease.token, began, time.monotonic()))
        lease.release()
    out.put(uses)


@pytest.mark.slow
def test_never_more_than_its_slots_hold_a_resource_at_once(processes, queue):
    Pool("shared").add("acct", slots=2)
    for _ in range(6):
        processes.start(_hold_slots, "shared", 3.0, queue)
    uses = [use for _ in range(6) for use in queue.get(timeout=60)]
    processes.join_all()
    assert len(uses) > 50, "too little contention to prove anything"
    events = sorted([(began, 1) for _, _, began, _ in uses] + [(ended, -1) for _, _, _, ended in uses])
    holders = peak = 0
    for _, step in events:
        holders += step
        peak = max(peak, holders)
    assert peak <= 2
    assert len({(slot, token) for slot, token, _, _ in uses}) == len(uses)  # a token once per slot


# -- cool-down -------------------------------------------------------------------------


def test_a_released_slot_rests_for_its_cooldown_by_the_database_clock():
    pool = Pool("proxies")
    pool.add("p1")
    lease = pool.acquire(ttl=30)
    assert lease.release(cooldown=1.0) is True
    assert pool.stats() == {"free": 0, "held": 0, "cooling": 1, "quarantined": 0, "total": 1}
    assert Resource.objects.get().holder == ""
    with pytest.raises(NoResourceAvailable):
        pool.acquire(ttl=30)
    began = time.monotonic()
    again = pool.acquire(ttl=30, wait=5)
    assert 0.5 <= time.monotonic() - began <= 3.0
    again.release()
    assert pool.stats()["free"] == 1  # no cool-down asked: free at once


def test_a_pools_cooldown_is_the_default_and_a_release_may_say_otherwise():
    pool = Pool("proxies", cooldown=60)
    pool.add_many([("p1", None), ("p2", None)])
    pool.acquire(ttl=30).release()
    assert pool.stats()["cooling"] == 1
    pool.acquire(ttl=30).release(cooldown=0)
    assert pool.stats() == {"free": 1, "held": 0, "cooling": 1, "quarantined": 0, "total": 2}
    assert pool.release("p1") or pool.release("p2")  # an operator's release ends a rest too


# -- fair waiting ----------------------------------------------------------------------


def _wait_fairly(pool_name: str, index: int, out) -> None:
    lease = Pool(pool_name).acquire(ttl=10, wait=30, fair=True)
    out.put((index, time.monotonic()))
    time.sleep(0.1)
    lease.release()


@pytest.mark.slow
def test_fair_waiters_are_served_in_the_order_they_came(processes, queue):
    pool = Pool("scarce")
    pool.add("only")
    held = pool.acquire(ttl=30)
    for index in range(4):
        processes.start(_wait_fairly, "scarce", index, queue)
        deadline = time.monotonic() + 10
        while Waiter.objects.filter(pool="scarce").count() < index + 1:  # in line before the next comes
            assert time.monotonic() < deadline, "a waiter never took a ticket"
            time.sleep(0.02)
    held.release()
    served = [queue.get(timeout=30) for _ in range(4)]
    processes.join_all()
    assert [index for index, _ in sorted(served, key=lambda item: item[1])] == [0, 1, 2, 3]
    assert not Waiter.objects.exists()  # each left the line


def _wait_and_die(pool_name: str) -> None:
    Pool(pool_name).acquire(ttl=10, wait=60, fair=True)


@pytest.mark.slow
def test_a_waiter_that_dies_in_line_holds_up_the_others_only_until_its_ticket_lapses(processes, queue):
    pool = Pool("scarce")
    pool.add("only")
    held = pool.acquire(ttl=30)
    doomed = processes.start(_wait_and_die, "scarce")
    deadline = time.monotonic() + 10
    while not Waiter.objects.filter(pool="scarce").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    processes.start(_wait_fairly, "scarce", 1, queue)
    time.sleep(0.3)
    released_at = time.monotonic()
    held.release()
    index, served_at = queue.get(timeout=30)
    assert index == 1 and served_at - released_at <= TICKET_TTL + 1.0


def test_without_wait_fair_changes_nothing():
    pool = Pool("p")
    pool.add("a")
    pool.acquire(ttl=30, fair=True).release()
    assert not Waiter.objects.exists()


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Pool("p").add("a", slots=0), "slots must be a whole number from 1 to 1000, not 0"),
        (lambda: Pool("p").add("a", slots=-2), "slots must be a whole number"),
        (lambda: Pool("p").add("a", slots="3"), "slots must be a whole number"),
        (lambda: Pool("p").add("a", slots=True), "slots must be a whole number"),
        (lambda: Pool("p").add("a", slots=1001), "slots must be a whole number from 1 to 1000"),
        (lambda: Pool("p", cooldown=-1), "cooldown must be a finite number of seconds >= 0"),
        (lambda: Pool("p", cooldown=float("inf")), "cooldown must be a finite number of seconds"),
    ],
)
def test_bad_slots_and_cooldowns_are_refused_and_write_nothing(call, message):
    with pytest.raises(ValueError, match=None) as info:
        call()
    assert message in str(info.value)
    assert not Resource.objects.exists()


def test_a_bad_cooldown_at_release_keeps_the_lease():
    pool = Pool("p")
    pool.add("a")
    lease = pool.acquire(ttl=30)
    with pytest.raises(ValueError, match="cooldown must be"):
        lease.release(cooldown=-5)
    assert not lease.released and lease.remaining() > 0 and lease.release() is True


def test_lease_add_with_slots_and_list_shows_them_in_use():
    import io

    from django.core.management import call_command

    out = io.StringIO()
    call_command("lease", "add", "accounts", "acct-7", "--slots", "3", stdout=out)
    assert out.getvalue() == "added accounts/acct-7 (3 slots)\n"
    Pool("accounts").acquire(ttl=60)
    out = io.StringIO()
    call_command("lease", "list", "accounts", stdout=out)
    lines = [line.split() for line in out.getvalue().splitlines()]
    assert [line[:3] for line in lines[1:]] == [["acct-7", str(slot), "1/3"] for slot in range(3)]
    assert sorted(line[3] for line in lines[1:]) == ["free", "free", "held"]  # which slot: any
