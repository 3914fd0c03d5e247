"""ResourceThread: acquire, heartbeat, re-acquire, quarantine the invalid, fix, terminate,
and ride out outages (simulated here by a failing db.run; test_lease_faults has real ones)."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import OperationalError

from leases import LeaseLost, Pool, ResourceThread, UnknownPool, db
from leases.lease import Lease
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
def crawler(resource_threads):
    return lambda **kwargs: resource_threads(Crawler, **kwargs)


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
    assert accounts.stats() == {"free": 0, "held": 1, "cooling": 0, "quarantined": 1, "total": 2}


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


class TerminatedAsAcquired(threading.Event):
    """The thread's stop event: the first time start() asks it after an acquire came
    back, terminate() runs in another thread (for up to 1 s) before the answer, "not
    stopped", is given: terminate() lands in the instant between the two."""

    def __init__(self, thread):
        super().__init__()
        self.thread, self.armed = thread, False

    def is_set(self):
        if self.armed and threading.current_thread() is not self.thread and not super().is_set():
            self.armed = False
            other = threading.Thread(target=self.thread.terminate)
            other.start()
            other.join(1.0)  # it may have to wait for the lease to be published first
            return False
        return super().is_set()


def test_terminate_as_an_acquire_comes_back_releases_what_it_got(accounts, crawler, monkeypatch):
    thread = crawler(ttl=30)  # so only a release frees it within the test
    stop = thread._stopping = TerminatedAsAcquired(thread)
    real = thread._pool.acquire

    def acquire(*args, **kwargs):
        lease = real(*args, **kwargs)
        stop.armed = True
        return lease

    monkeypatch.setattr(thread._pool, "acquire", acquire)
    thread.start()
    wait_for(lambda: accounts.stats()["held"] == 0, timeout=3)  # released, not left to its ttl
    assert not thread.is_alive()


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


# -- outages and failing checks -------------------------------------------------------------


@pytest.fixture
def outage(monkeypatch):
    """While `outage.on`, every db.run fails as if the server refused connections; while
    `outage.hung`, it blocks as if the server stopped answering."""

    class Outage:
        on = False
        calls = 0
        hung = threading.Event()
        unblocked = threading.Event()

    real = db.run

    def run(work, using=None, attempts=8, **options):
        if Outage.hung.is_set():
            Outage.unblocked.wait(30)
        if Outage.on:
            Outage.calls += 1
            raise OperationalError(2003, "Can't connect to server on '127.0.0.1' (111)")
        return real(work, using, attempts, **options)

    monkeypatch.setattr(db, "run", run)
    yield Outage
    Outage.unblocked.set()


def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_start_during_an_outage_blocks_says_so_now_and_then_holds(accounts, crawler, outage, caplog):
    caplog.set_level(logging.INFO, logger="leases")
    outage.on = True
    threading.Timer(1.0, lambda: setattr(outage, "on", False)).start()
    thread = crawler()
    thread.wait_step = 0.6  # many failed attempts, few log lines
    started = time.monotonic()
    thread.start()
    assert time.monotonic() - started >= 1.0
    assert thread.is_alive() and thread.lease.remaining() > 0
    said = messages(caplog, "database unreachable")
    assert 1 <= len(said) <= 2 < outage.calls
    # Said by the thread, named after its pool until it holds a resource:
    assert said[0].startswith("accounts: database unreachable ((2003, ") and "retrying" in said[0]
    assert thread.name == f"accounts/{thread.lease.name}"
    assert messages(caplog, f"holding accounts/{thread.lease.name} (token")


def test_the_thread_rides_out_an_outage_longer_than_its_ttl(accounts, crawler, outage, caplog):
    caplog.set_level(logging.INFO, logger="leases")
    thread = crawler()
    thread.start()
    first = thread.lease
    outage.on = True
    time.sleep(Crawler.ttl * 2)
    assert thread.is_alive()
    assert thread.lease is first and first.lost and first.remaining() == 0  # says it is not held
    with pytest.raises(LeaseLost):
        thread.lease.check()
    outage.on = False
    wait_for(lambda: thread.lease is not first and thread.lease.remaining() > 0)
    lease = thread.lease
    assert thread.is_alive() and lease.token > (first.token if lease.name == first.name else 0)
    row = Resource.objects.get(pool="accounts", name=lease.name)
    assert (row.holder, row.token) == (lease.holder, lease.token)
    assert messages(caplog, "database unreachable")
    assert messages(caplog, f"holding accounts/{lease.name} again (token {lease.token})")
    time.sleep(Crawler.ttl * 1.5)  # and the heartbeat keeps the new lease
    assert thread.lease is lease and lease.remaining() > 0


class Crashing(Crawler):
    def is_valid(self) -> bool:
        if self.lease.name == "broken":
            raise RuntimeError("check crashed")
        return True


def test_an_exception_from_is_valid_counts_as_invalid_and_becomes_the_reason(accounts, caplog):
    accounts.quarantine("good", 0.5)  # so the thread meets "broken" first
    thread = Crashing()
    try:
        thread.start()
        assert thread.lease.name == "good" and thread.is_alive()
        broken = Resource.objects.get(pool="accounts", name="broken")
        assert broken.quarantine_reason == "Crashing.is_valid() raised RuntimeError: check crashed"
        assert "RuntimeError: check crashed" in caplog.text
    finally:
        thread.terminate()


def test_an_exception_from_is_valid_is_one_warning_line_without_a_traceback(accounts, caplog):
    """A resource that fails its check is routine (it is quarantined): its type and message
    on one WARNING line, no traceback to scroll past."""
    caplog.set_level(logging.DEBUG, logger="leases")
    accounts.quarantine("good", 0.5)  # so the thread meets "broken" first
    thread = Crashing()
    try:
        thread.start()
        said = [r for r in caplog.records if "is_valid() raised" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert said[0].getMessage().endswith("RuntimeError: check crashed")
        assert said[0].exc_info is None and "\n" not in said[0].getMessage()
        assert "Traceback" not in caplog.text
    finally:
        thread.terminate()


def test_terminate_returns_within_its_timeout_while_the_database_hangs(accounts, crawler, outage):
    thread = crawler()
    thread.start()
    outage.hung.set()
    time.sleep(Crawler.interval * 2)  # a renewal is stuck now
    started = time.monotonic()
    thread.terminate(timeout=0.5)
    assert time.monotonic() - started < 1.0


def test_start_raises_what_waiting_cannot_cure(crawler):
    with pytest.raises(UnknownPool):
        crawler(pool="nothing").start()


def test_an_invalid_resource_removed_before_its_quarantine_is_skipped(accounts, crawler, monkeypatch):
    monkeypatch.setattr(Crawler, "bad", {"broken"})
    accounts.quarantine("good", 0.5)  # so the thread meets "broken" first
    quarantine = Lease.quarantine

    def removed_first(lease, *args, **kwargs):
        if lease.name == "broken":
            Pool(lease.pool).remove(lease.name)  # an operator was quicker
        return quarantine(lease, *args, **kwargs)

    monkeypatch.setattr(Lease, "quarantine", removed_first)
    thread = crawler()
    thread.start()
    assert thread.lease.name == "good" and thread.is_alive()
    assert not Resource.objects.filter(name="broken").exists()
