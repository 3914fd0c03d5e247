"""The lease rules that are about concurrency, with real processes, SIGKILL and SIGSTOP."""
from __future__ import annotations

import os
import random
import signal
import time
from datetime import datetime, timedelta, timezone

import pytest

from leases import LeaseLost, NoResourceAvailable, Pool, ResourceThread
from leases.clock import db_now
from leases.models import Resource
from tests.conftest import CONTEXT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _contend(pool_name, names, seconds, occupancy, lock, out):
    """Acquire and release as fast as possible, counting how many hold each resource."""
    pool = Pool(pool_name)
    got, overlaps = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            lease = pool.acquire(ttl=30, wait=1)
        except NoResourceAvailable:
            continue
        i = names.index(lease.name)
        with lock:
            occupancy[i] += 1
            overlaps += occupancy[i] > 1
        time.sleep(random.uniform(0, 0.005))
        with lock:
            occupancy[i] -= 1
        released = lease.release()
        got.append((lease.name, lease.token, released))
    out.put((got, overlaps))


def _add_all(names, start, out):
    """Add the same new resources as the other processes, at the same moment."""
    time.sleep(max(0.0, start - time.monotonic()))
    new, errors = 0, []
    for name in names:
        try:
            new += Pool("accounts").add(name, slots=2)
        except Exception as exc:  # noqa: BLE001 - reported: a racing add must not fail
            errors.append(f"{type(exc).__name__}: {exc}")
    out.put((new, errors))


def test_adds_of_the_same_new_resources_racing_in_four_processes_all_succeed(processes, queue):
    names = [f"acct-{i}" for i in range(100)]
    start = time.monotonic() + 1.0
    for _ in range(4):
        processes.start(_add_all, names, start, queue)
    results = [queue.get(timeout=60) for _ in range(4)]
    processes.join_all()
    assert [e for _, errors in results for e in errors] == []
    assert sum(new for new, _ in results) == len(names)  # each was new to exactly one adder
    names_of_rows = Resource.objects.filter(pool="accounts").values_list("name", flat=True)
    assert sorted(names_of_rows) == sorted(names * 2)  # two slots each, none doubled


def test_no_resource_is_ever_held_twice_under_contention(processes, queue):
    names = ["r0", "r1", "r2"]
    Pool("hot").add_many([(n, None) for n in names])
    occupancy, lock = CONTEXT.Array("i", len(names)), CONTEXT.Lock()
    for _ in range(8):
        processes.start(_contend, "hot", names, 3.0, occupancy, lock, queue)
    results = [queue.get(timeout=60) for _ in range(8)]
    processes.join_all()

    acquisitions = [a for got, _ in results for a in got]
    assert sum(overlaps for _, overlaps in results) == 0
    assert all(released for _, _, released in acquisitions)
    assert len(acquisitions) > 30, "too little contention to prove anything"
    # Each acquisition got its own token, and tokens of a resource count up without gaps.
    pairs = [(name, token) for name, token, _ in acquisitions]
    assert len(pairs) == len(set(pairs))
    for name in names:
        tokens = sorted(t for n, t in pairs if n == name)
        assert tokens == list(range(1, len(tokens) + 1))
        assert Resource.objects.get(pool="hot", name=name).token == len(tokens)


def _acquire_and_hang(pool_name, ttl, out):
    before = time.monotonic()
    lease = Pool(pool_name).acquire(ttl=ttl)
    out.put((before, lease.name, lease.token))
    time.sleep(3600)


def test_a_sigkilled_holder_loses_its_lease_after_ttl_and_not_before(processes, queue):
    pool = Pool("one")
    pool.add("only")
    child = processes.start(_acquire_and_hang, "one", 2.0, queue)
    before, name, token = queue.get(timeout=30)
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(NoResourceAvailable):
        pool.acquire(wait=0)
    lease = pool.acquire(ttl=30, wait=10)
    got = time.monotonic()
    assert lease.name == name and lease.token == token + 1
    assert got - before >= 2.0, "the lease came back before its ttl"
    assert got - before < 2.0 + 3.0, "the lease took far longer than its ttl to come back"


class Holder(ResourceThread):
    pool = "one"
    ttl = 2.0
    interval = 0.4


def _hold_with_thread(out):
    thread = Holder()
    thread.start()
    out.put((thread.lease.name, thread.lease.token))
    time.sleep(3600)


def test_a_heartbeating_process_keeps_its_resource_until_sigkill(processes, queue):
    pool = Pool("one")
    pool.add("only")
    child = processes.start(_hold_with_thread, queue)
    name, token = queue.get(timeout=30)
    time.sleep(3.0)  # 1.5 ttl: only the heartbeat can have kept it
    with pytest.raises(NoResourceAvailable):
        pool.acquire(wait=0)
    assert Resource.objects.get(pool="one").token == token  # renewals never bump the token
    os.kill(child.pid, signal.SIGKILL)
    killed = time.monotonic()
    lease = pool.acquire(ttl=30, wait=10)
    back = time.monotonic() - killed
    # The last renewal was at most one interval before the kill.
    assert Holder.ttl - Holder.interval - 0.1 <= back < Holder.ttl + 3.0
    assert lease.token == token + 1


def _pause_then_renew(pool_name, out, resumed):
    lease = Pool(pool_name).acquire(ttl=1.0)
    out.put(("acquired", lease.token))
    resumed.wait(60)  # the parent SIGSTOPs us past the ttl before setting this
    try:
        lease.renew()
        out.put(("renewed", None))
    except LeaseLost:
        out.put(("lost", lease.release()))


def test_a_paused_holder_cannot_renew_or_release_after_another_took_over(processes, queue):
    pool = Pool("one")
    pool.add("only")
    resumed = CONTEXT.Event()
    child = processes.start(_pause_then_renew, "one", queue, resumed)
    assert queue.get(timeout=30)[0] == "acquired"
    os.kill(child.pid, signal.SIGSTOP)
    try:
        lease = pool.acquire(ttl=30, wait=10)  # granted once the stopped holder's ttl passes
    finally:
        os.kill(child.pid, signal.SIGCONT)
    resumed.set()
    assert queue.get(timeout=30) == ("lost", False)
    row = Resource.objects.get(pool="one")
    assert (row.holder, row.token) == (lease.holder, lease.token)
    lease.renew()


def _skewed_client(pool_name, offset, out, step):
    """A process whose every Python clock is `offset` seconds off."""
    import django.utils.timezone

    real_time, real_ns = time.time, time.time_ns
    time.time = lambda: real_time() + offset
    time.time_ns = lambda: real_ns() + int(offset * 1e9)
    django.utils.timezone.now = lambda: datetime.now(timezone.utc) + timedelta(seconds=offset)
    pool = Pool(pool_name)
    try:
        pool.acquire(wait=0)
        out.put("stole")
    except NoResourceAvailable:
        out.put("refused")
    step.wait(30)  # the parent releases its lease
    lease = pool.acquire(ttl=1.5)
    out.put(("acquired", lease.expires_at))
    time.sleep(0.7)
    lease.renew()
    out.put("renewed")
    time.sleep(3600)  # dies without releasing


@pytest.mark.parametrize("offset", [3600, -3600])
def test_a_client_with_a_skewed_clock_can_neither_steal_nor_lose_a_lease(processes, queue, offset):
    pool = Pool("one")
    pool.add("only")
    mine = pool.acquire(ttl=30)
    step = CONTEXT.Event()
    child = processes.start(_skewed_client, "one", offset, queue, step)
    assert queue.get(timeout=30) == "refused"
    mine.release()
    step.set()
    kind, expires_at = queue.get(timeout=30)
    # The child's expiry estimate is on the database clock, not its own.
    assert abs((expires_at - db_now()).total_seconds() - 1.5) < 1.0
    assert queue.get(timeout=30) == "renewed"
    with pytest.raises(NoResourceAvailable):
        pool.acquire(wait=0)  # its lease did not expire early
    start = time.monotonic()
    lease = pool.acquire(wait=10)  # nor does it last an hour
    assert time.monotonic() - start < 3.0
    assert lease.token == mine.token + 2
    child.kill()
