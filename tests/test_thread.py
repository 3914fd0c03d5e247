"""ResourceThread: acquire, heartbeat, re-acquire, quarantine the invalid, fix, terminate."""
from __future__ import annotations

import logging
import time

import pytest

from leases import Pool, ResourceThread
from leases.models import Resource

pytestmark = pytest.mark.django_db(transaction=True)


class Crawler(ResourceThread):
    pool = "accounts"
    ttl = 0.6
    interval = 0.15
    wait_step = 0.3
    bad: set[str] = set()

    def is_valid(self) -> bool:
        return self.lease.name not in self.bad


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture
def accounts():
    pool = Pool("accounts")
    pool.add_many([("good", None), ("broken", None)])
    return pool


@pytest.fixture
def crawler():
    threads = []

    def make(**kwargs):
        thread = Crawler(**kwargs)
        threads.append(thread)
        return thread

    yield make
    for thread in threads:
        thread.terminate()


def test_start_acquires_and_the_heartbeat_keeps_the_lease(accounts, crawler):
    thread = crawler()
    thread.start()
    lease = thread.lease
    assert thread.is_alive() and lease is not None
    time.sleep(1.5)  # more than twice the ttl
    assert thread.lease is lease and not lease.lost
    row = Resource.objects.get(pool="accounts", name=lease.name)
    assert (row.holder, row.token) == (lease.holder, lease.token)
    assert accounts.stats()["held"] == 1


def test_an_invalid_resource_is_quarantined_and_another_taken(accounts, crawler, monkeypatch):
    monkeypatch.setattr(Crawler, "bad", {"broken"})
    accounts.quarantine("good", 0.5)  # so the crawler meets "broken" first
    thread = crawler()
    thread.start()
    assert thread.lease.name == "good"
    broken = Resource.objects.get(pool="accounts", name="broken")
    assert broken.quarantine_reason == "Crawler.is_valid() returned False"
    assert accounts.stats() == {"free": 0, "held": 1, "quarantined": 1, "total": 2}


def test_a_failed_renewal_acquires_again(accounts, crawler):
    thread = crawler()
    thread.start()
    first = thread.lease
    accounts.release(first.name)  # an operator takes it away
    wait_for(lambda: thread.lease is not first)
    assert first.lost and thread.lease.remaining() > 0
    assert thread.is_alive()
    assert accounts.stats()["held"] == 1


def test_fix_replaces_an_invalid_resource(accounts, crawler, monkeypatch):
    Pool("accounts").quarantine("broken", 60)
    thread = crawler()
    thread.start()
    assert thread.fix() is False  # valid: nothing to do
    first = thread.lease
    monkeypatch.setattr(Crawler, "bad", {first.name})
    accounts.unquarantine("broken")
    assert thread.fix() is True
    assert thread.lease.name == "broken" and first.released
    time.sleep(0.5)  # the heartbeat carries on with the new lease
    assert not thread.lease.lost and thread.is_alive()


def test_terminate_releases_and_stops(accounts, crawler):
    thread = crawler()
    thread.start()
    thread.terminate()
    assert not thread.is_alive()
    assert thread.lease.released
    assert accounts.stats()["held"] == 0


def _hold_briefly(pool_name, names):
    for _ in names:
        Pool(pool_name).acquire(ttl=0.8)
    time.sleep(3600)  # never released: the ttl frees them


def test_start_waits_while_the_pool_is_exhausted_and_says_so(accounts, crawler, processes, caplog):
    processes.start(_hold_briefly, "accounts", ["a", "b"])
    wait_for(lambda: accounts.stats()["held"] == 2)
    caplog.set_level(logging.INFO, logger="leases")
    started = time.monotonic()
    thread = crawler()
    thread.start()
    assert thread.lease is not None
    assert time.monotonic() - started > 0.3
    assert "pool 'accounts' exhausted, waiting" in caplog.text
