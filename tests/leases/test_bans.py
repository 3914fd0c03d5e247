"""Bans that touch only their own holding: Lease.quarantine, ResourceThread.replace and
fix(), and what a ResourceThread offers a crawler (fair waits, names, hooks, a wait that
terminate() ends at once, a prompt first renewal after a swap)."""
from __future__ import annotations

import threading
import time

import pytest

from leases import LeaseLost, NoResourceAvailable, Pool, ResourceThread
from leases.lease import Lease
from leases.models import Resource
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def proxies():
    pool = Pool("proxies")
    pool.add_many([("p1", None), ("p2", None), ("p3", None)])
    return pool


@pytest.fixture
def threads(resource_threads):
    """Holder threads of the proxies pool with a short ttl."""
    return lambda cls=ResourceThread, **options: resource_threads(
        cls, **{"pool": "proxies", "ttl": 1.0, "interval": 0.25, **options})


def row(name: str) -> Resource:
    return Resource.objects.get(pool="proxies", name=name)


def test_a_holder_quarantines_what_it_holds(proxies):
    lease = proxies.acquire(ttl=30)
    lease.quarantine(60, "ban: HTTP 403 https://example.com/")
    banned = row(lease.name)
    assert banned.quarantine_reason == "ban: HTTP 403 https://example.com/" and banned.holder == ""
    assert banned.token == lease.token + 1  # the fencing token grows
    assert proxies.stats()["quarantined"] == 1 and lease.remaining() == 0
    with pytest.raises(LeaseLost):
        lease.renew()


def test_a_ban_of_an_older_holding_is_refused_and_touches_nothing(proxies):
    proxies.quarantine("p2", 60)
    proxies.quarantine("p3", 60)
    old = proxies.acquire(ttl=0.3)
    time.sleep(0.4)  # it ran out; the next holder takes the same proxy
    new = proxies.acquire(ttl=30)
    assert new.name == old.name
    before = row(new.name)
    with pytest.raises(LeaseLost) as refused:
        old.quarantine(60, "ban: a late 403")
    assert "\n" not in str(refused.value) and "not quarantined" in str(refused.value)
    after = row(new.name)
    assert (after.holder, after.token, after.quarantined_until) == (before.holder, before.token, None)
    new.renew()  # still the new holder's


def test_a_ban_takes_out_only_the_slot_it_holds():
    pool = Pool("accounts")
    pool.add("shared", slots=2)
    mine, theirs = pool.acquire(ttl=30), pool.acquire(ttl=30)
    mine.quarantine(60, "ban")
    theirs.renew()  # the other holder of the resource keeps its slot
    assert pool.stats()["quarantined"] == 1 and pool.stats()["held"] == 1


def test_replace_quarantines_the_old_and_renews_the_new_one_interval_after_it_was_taken(
        proxies, threads, monkeypatch):
    renewed: dict[int, list[float]] = {}
    real = Lease.renew

    def renew(lease, *args, **kwargs):
        renewed.setdefault(lease.token * 1000 + lease.id, []).append(time.monotonic())
        return real(lease, *args, **kwargs)

    monkeypatch.setattr(Lease, "renew", renew)
    thread = threads(ttl=2.0, interval=0.8)
    thread.start()
    first = thread.lease
    time.sleep(0.5)  # the heartbeat sleeps toward its next tick on the first lease
    taken = time.monotonic()
    new = thread.replace(quarantine=60, reason="ban: HTTP 403")
    assert new is thread.lease and new.name != first.name
    assert row(first.name).quarantine_reason == "ban: HTTP 403"
    wait_for(lambda: renewed.get(new.token * 1000 + new.id), timeout=3, what="the new lease's first renewal")
    gap = renewed[new.token * 1000 + new.id][0] - taken
    assert gap < 0.8 + 0.3  # its interval after the swap, not the old lease's tick plus another interval


def test_replace_of_a_lease_already_replaced_leaves_the_new_one_alone(proxies, threads):
    thread = threads()
    thread.start()
    first = thread.lease
    second = thread.replace()
    assert thread.replace(quarantine=60, reason="late", of=first) is second
    assert not Resource.objects.filter(pool="proxies").exclude(quarantined_until=None).exists()


def test_fix_quarantines_an_invalid_resource_instead_of_releasing_it(proxies, threads):
    class Checked(ResourceThread):
        bad: set[str] = set()

        def is_valid(self) -> bool:
            return self.lease.name not in self.bad

    thread = threads(Checked)
    thread.start()
    first = thread.lease
    Checked.bad = {first.name}
    assert thread.fix() is True
    assert thread.lease.name != first.name
    assert row(first.name).quarantine_reason == "Checked.is_valid() returned False"


def test_hooks_hear_of_each_change(proxies, threads):
    heard: list[tuple] = []

    class Told(ResourceThread):
        def on_acquired(self, lease):
            heard.append(("acquired", lease.name))

        def on_lost(self, lease):
            heard.append(("lost", lease.name))

        def on_replaced(self, old, new):
            heard.append(("replaced", old.name, new.name))

    thread = threads(Told)
    thread.start()
    first = thread.lease
    second = thread.replace()
    proxies.release(second.name)  # an operator takes it
    wait_for(lambda: ("lost", second.name) in heard, timeout=5)
    wait_for(lambda: len(heard) == 5, timeout=5)
    assert heard[:3] == [("acquired", first.name), ("acquired", second.name), ("replaced", first.name, second.name)]
    assert heard[3] == ("lost", second.name) and heard[4][0] == "acquired"


def test_threads_are_named_after_their_pool_then_their_resource(proxies, threads):
    thread = threads()
    assert thread.name == "proxies"
    thread.start()
    assert thread.name == f"proxies/{thread.lease.name}"
    assert threads(name="mine").name == "mine"


def test_terminate_ends_a_wait_for_a_free_resource_at_once(proxies, threads):
    held = [proxies.acquire(ttl=30) for _ in range(3)]
    thread = threads()
    thread.wait_step = 30  # no round trip of its own would end the wait sooner
    waiter = threading.Thread(target=thread.start)
    waiter.start()
    time.sleep(0.5)
    asked = time.monotonic()
    thread.terminate()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - asked < 0.5
    assert thread.lease is None and not thread.is_alive()
    assert all(lease.remaining() > 0 for lease in held)


def test_fair_threads_are_served_in_the_order_they_came(proxies, threads):
    held = [proxies.acquire(ttl=30) for _ in range(3)]
    order: list[str] = []
    waiting = []
    for name in ("first", "second"):
        thread = threads(fair=True, name=name)
        waiter = threading.Thread(target=lambda t=thread: (t.start(), order.append(t.name)))
        waiter.start()
        waiting.append(waiter)
        time.sleep(0.4)  # the first takes its ticket before the second
    held[0].release()
    wait_for(lambda: order, timeout=5)
    assert order == ["first"]
    held[1].release()
    for waiter in waiting:
        waiter.join(5)
    assert order == ["first", "second"]


def test_start_with_a_timeout_gives_up(proxies, threads):
    [proxies.acquire(ttl=30) for _ in range(3)]
    started = time.monotonic()
    with pytest.raises(NoResourceAvailable):
        threads().start(timeout=0.5)
    assert time.monotonic() - started < 2
