"""The lease engine's rules, one process at a time (concurrency is in test_concurrency)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction

from leases import LeaseLost, NoResourceAvailable, Pool, UnknownPool, UnknownResource, db
from leases.clock import db_now
from leases.lease import Heartbeat, release_within
from leases.models import Resource

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pool():
    p = Pool("proxies")
    p.add("a", data={"url": "http://a"})
    return p


def row(name: str, pool: str = "proxies") -> Resource:
    return Resource.objects.get(pool=pool, name=name)


# -- membership and bad input ---------------------------------------------------------


def test_add_is_idempotent_and_updates_data_only_when_given(pool):
    assert pool.add("a") is False
    assert row("a").data == {"url": "http://a"}
    assert pool.add("a", data={"url": "http://b"}) is False
    assert row("a").data == {"url": "http://b"}
    assert pool.add("b") is True
    assert Resource.objects.filter(pool="proxies").count() == 2


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Pool(""), "pool name must be a non-empty string"),
        (lambda: Pool("x" * 101), "pool name is longer than 100"),
        (lambda: Pool("p").add(""), "resource name must be a non-empty string"),
        (lambda: Pool("p").add("n" * 256), "resource name is longer than 255"),
        (lambda: Pool("p").add("n", data={"x": object()}), "data must be JSON-serialisable"),
        (lambda: Pool("p").add("n", data={"x": float("nan")}), "data must be JSON-serialisable"),
        (lambda: Pool("p").add_many([("ok", None), ("", None)]), "resource name must be"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert not Resource.objects.exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ttl": 0}, "ttl must be a finite number of seconds > 0"),
        ({"ttl": -1}, "ttl must be"),
        ({"ttl": "60"}, "ttl must be"),
        ({"ttl": True}, "ttl must be"),
        ({"ttl": float("inf")}, "ttl must be a finite number"),
        ({"wait": float("nan")}, "wait must be"),
        ({"wait": -1}, "wait must be a finite number of seconds >= 0"),
        ({"holder": ""}, "holder must be a non-empty string"),
        ({"holder": "h" * 250}, "holder is longer than"),
    ],
)
def test_acquire_refuses_bad_arguments(pool, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pool.acquire(**kwargs)
    assert pool.stats()["held"] == 0


def test_acquire_from_a_pool_without_resources_says_so_and_names_the_known_pools(monkeypatch):
    with pytest.raises(UnknownPool, match=r"pool 'nothing' has no resources \(known pools: none yet\)$"):
        Pool("nothing").acquire(wait=5)
    for name in ("proxies", "accounts", "proxies"):
        Pool(name).add(f"r-{name}-{Resource.objects.count()}")
    with pytest.raises(UnknownPool, match=r"\(known pools: accounts, proxies\)$"):
        Pool("proxy").acquire(wait=5)
    monkeypatch.setattr("leases.pool.KNOWN_SHOWN", 1)
    with pytest.raises(UnknownPool, match=r"\(known pools: accounts, ...\)$"):
        Pool("proxy").acquire()


def test_add_many_writes_all_in_batches_with_progress():
    seen = []
    count = Pool("p").add_many([(f"r{i}", {"i": i} if i % 2 else None) for i in range(25)], 10, seen.append)
    assert count == 25 and seen == [10, 10, 5]
    assert Resource.objects.filter(pool="p").count() == 25
    assert row("r3", "p").data == {"i": 3} and row("r4", "p").data == {}


# -- acquire, renew, release ----------------------------------------------------------


def test_acquire_returns_a_lease_with_holder_token_and_expiry(pool):
    before = db_now()
    lease = pool.acquire(ttl=30)
    r = row("a")
    assert (lease.pool, lease.name, lease.resource) == ("proxies", "a", {"url": "http://a"})
    assert lease.token == r.token == 1
    assert lease.holder == r.holder and lease.holder.count(":") == 2  # host:pid:random
    # The estimate comes from the database clock and never overshoots the real expiry.
    assert before + timedelta(seconds=29) < lease.expires_at <= r.busy_before
    assert r.busy_before - lease.expires_at < timedelta(seconds=1)
    assert 29 < lease.remaining() <= 30


def test_each_acquisition_gets_a_new_holder_and_a_larger_token(pool):
    tokens, holders = [], set()
    for _ in range(3):
        lease = pool.acquire(ttl=30, holder="crawler-1")
        tokens.append(lease.token)
        holders.add(lease.holder)
        assert lease.holder.startswith("crawler-1:")
        lease.release()
    assert tokens == [1, 2, 3]
    assert len(holders) == 3


def test_an_exhausted_pool_fails_at_once_or_after_wait(pool):
    pool.acquire(ttl=30)
    with pytest.raises(NoResourceAvailable, match="no free resource in pool 'proxies'"):
        pool.acquire(wait=0)
    start = time.monotonic()
    with pytest.raises(NoResourceAvailable, match="within 0.5s"):
        pool.acquire(wait=0.5)
    assert 0.5 <= time.monotonic() - start < 3


def test_release_frees_and_renew_after_release_fails(pool):
    lease = pool.acquire(ttl=30)
    assert lease.release() is True
    assert pool.stats() == {"free": 1, "held": 0, "cooling": 0, "quarantined": 0, "total": 1}
    assert row("a").holder == ""
    with pytest.raises(LeaseLost):
        lease.renew()
    assert lease.release() is False


def test_renew_extends_by_the_database_clock(pool):
    lease = pool.acquire(ttl=1)
    first = row("a").busy_before
    lease.renew(ttl=60)
    r = row("a")
    assert r.busy_before - first > timedelta(seconds=58)
    assert r.renewed_at >= r.acquired_at  # SQLite ticks in milliseconds
    assert lease.ttl == 60 and lease.remaining() > 59


def test_renew_after_expiry_fails_and_extends_nothing(pool):
    lease = pool.acquire(ttl=0.3)
    time.sleep(0.5)
    with pytest.raises(LeaseLost, match="expired or passed to another holder"):
        lease.renew()
    assert lease.lost and lease.remaining() == 0
    assert row("a").busy_before <= db_now()
    with pytest.raises(LeaseLost):
        lease.check()


def test_a_stale_holder_can_neither_renew_nor_release_the_new_lease(pool):
    stale = pool.acquire(ttl=0.3)
    time.sleep(0.5)
    fresh = pool.acquire(ttl=30)
    assert fresh.token == stale.token + 1
    with pytest.raises(LeaseLost):
        stale.renew()
    assert stale.release() is False
    r = row("a")
    assert (r.holder, r.token) == (fresh.holder, fresh.token)
    assert pool.stats()["held"] == 1
    fresh.renew()


def test_lease_context_renews_in_the_background_and_releases_on_exit(pool):
    with pool.lease(ttl=0.6, interval=0.15) as lease:
        time.sleep(1.5)  # well past the ttl: only the heartbeat keeps it
        assert not lease.lost
        assert lease.remaining() > 0
        assert pool.stats()["held"] == 1
        token = lease.token
    assert lease.released
    assert pool.stats()["free"] == 1
    assert row("a").token == token


def test_lease_context_reports_a_lost_lease(pool):
    with pool.lease(ttl=0.6, interval=0.1) as lease:
        assert pool.release("a") is True  # an operator takes it away
        deadline = time.monotonic() + 3
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost
        with pytest.raises(LeaseLost):
            lease.check()
    assert pool.stats()["free"] == 1


# -- operators: quarantine and forced release ------------------------------------------


def test_quarantine_takes_a_resource_out_of_service_and_ousts_its_holder(pool):
    lease = pool.acquire(ttl=30)
    pool.quarantine("a", 60, reason="banned")
    r = row("a")
    assert r.state_at(db_now()) == Resource.QUARANTINED and r.quarantine_reason == "banned"
    assert r.token == lease.token + 1 and r.holder == ""
    assert pool.stats() == {"free": 0, "held": 0, "cooling": 0, "quarantined": 1, "total": 1}
    with pytest.raises(LeaseLost):
        lease.renew()
    with pytest.raises(NoResourceAvailable):
        pool.acquire()
    assert pool.unquarantine("a") is True
    assert pool.unquarantine("a") is False
    assert pool.acquire().name == "a"


def test_quarantine_ends_by_itself(pool):
    pool.quarantine("a", 0.3, reason="flaky")
    with pytest.raises(NoResourceAvailable):
        pool.acquire()
    time.sleep(0.5)
    lease = pool.acquire()
    r = row("a")
    assert r.quarantined_until is None and r.quarantine_reason == ""
    assert lease.token == r.token


def test_operator_release_frees_a_held_resource_and_bumps_the_token(pool):
    lease = pool.acquire(ttl=30)
    assert pool.release("a") is True
    assert pool.release("a") is False  # not held any more
    assert row("a").token == lease.token + 1
    with pytest.raises(LeaseLost):
        lease.renew()
    assert pool.acquire().token == lease.token + 2


def test_operator_commands_on_unknown_resources_raise(pool):
    for call in (pool.release, pool.unquarantine, lambda n: pool.quarantine(n, 10)):
        with pytest.raises(UnknownResource, match="no resource 'zz' in pool 'proxies'"):
            call("zz")
    with pytest.raises(ValueError, match="quarantine seconds must be"):
        pool.quarantine("a", 0)


def test_remove_deletes_and_the_holder_loses_it(pool):
    lease = pool.acquire(ttl=30)
    assert pool.remove("a") is True and pool.remove("a") is False
    with pytest.raises(LeaseLost):
        lease.renew()


# -- rules about row counts, retries and dropped connections ---------------------------


def test_every_success_changes_a_column_so_counts_hold_without_found_rows(pool):
    """A driver that reports changed (not matched) rows must still see 1 for a success."""
    if connection.vendor != "mysql":
        pytest.skip("the FOUND_ROWS distinction exists only on MySQL/MariaDB")
    import MySQLdb

    s = connection.settings_dict
    raw = MySQLdb.connect(host=s["HOST"] or "127.0.0.1", port=int(s["PORT"] or 3306), user=s["USER"],
                          password=s["PASSWORD"], database=s["NAME"], autocommit=True)
    try:
        from leases.sql import statements

        st = statements(connection)
        lease = pool.acquire(ttl=30)
        cur = raw.cursor()
        for _ in range(3):  # back-to-back renewals within the same microsecond range
            cur.execute(st.renew, (30_000_000, lease.id, lease.token, lease.holder))
            assert cur.rowcount == 1
        cur.execute(st.release, (0, lease.id, lease.token, lease.holder))  # no cool-down
        assert cur.rowcount == 1
    finally:
        raw.close()


def test_run_retries_deadlocks_and_reopens_dropped_connections(monkeypatch):
    monkeypatch.setattr(db.time, "sleep", lambda s: None)
    calls = []

    def flaky(cursor, resumed):
        calls.append(resumed)
        if len(calls) == 1:
            raise OperationalError(1213, "Deadlock found when trying to get lock")
        if len(calls) == 2:
            raise OperationalError(2013, "Lost connection to server during query")
        return "done"

    assert db.run(flaky) == "done"
    assert calls == [False, False, True]  # after the lost connection the outcome is unknown


def test_run_does_not_retry_other_errors_or_inside_a_transaction(monkeypatch):
    monkeypatch.setattr(db.time, "sleep", lambda s: None)
    calls = []

    def broken(cursor, resumed):
        calls.append(1)
        raise OperationalError(1054, "Unknown column")

    with pytest.raises(OperationalError):
        db.run(broken)
    assert len(calls) == 1

    def deadlock(cursor, resumed):
        calls.append(1)
        raise OperationalError(1213, "Deadlock")

    with pytest.raises(OperationalError), transaction.atomic():
        db.run(deadlock)
    assert len(calls) == 2


def test_a_claim_that_committed_before_the_connection_dropped_is_recognised(pool):
    from leases.pool import Pool as P

    claim = P._claimer(row("a").id, 0, "me:1:abcd", 30)
    assert db.run(claim) == 1
    # Retrying after a lost reply: the token moved on, but the row is ours, with that token.
    assert db.run(lambda cursor, resumed: claim(cursor, True)) == 1
    other = P._claimer(row("a").id, 0, "someone:2:ef01", 30)
    assert db.run(lambda cursor, resumed: other(cursor, True)) is None


def test_a_connection_killed_by_the_server_is_reopened(pool):
    if connection.vendor != "mysql":
        pytest.skip("needs a server to kill the connection")
    import MySQLdb

    connection.ensure_connection()
    victim = connection.connection.thread_id()
    s = connection.settings_dict
    killer = MySQLdb.connect(host=s["HOST"] or "127.0.0.1", port=int(s["PORT"] or 3306), user=s["USER"],
                             password=s["PASSWORD"])
    killer.cursor().execute("KILL %s", (victim,))
    killer.close()
    lease = pool.acquire(ttl=30)
    assert lease.name == "a"
    assert connection.connection.thread_id() != victim


# -- outages: acquire waits them out, releases are bounded --------------------------------

REFUSED = OperationalError(2003, "Can't connect to server on '127.0.0.1' (111)")


@pytest.fixture
def outage(monkeypatch):
    """Make every db.run fail as if the server refused connections while `outage.on`."""

    class Outage:
        on = True
        calls = 0

    real = db.run

    def run(work, using=None, attempts=8, **options):
        if Outage.on:
            Outage.calls += 1
            raise REFUSED
        return real(work, using, attempts, **options)

    monkeypatch.setattr(db, "run", run)
    return Outage


def test_acquire_with_wait_rides_out_an_outage_and_says_so(pool, outage, caplog):
    caplog.set_level("INFO", logger="leases")
    threading.Timer(0.6, lambda: setattr(outage, "on", False)).start()
    started = time.monotonic()
    lease = pool.acquire(ttl=30, wait=10)
    assert 0.6 <= time.monotonic() - started < 3
    assert outage.calls >= 2 and row("a").holder == lease.holder
    assert "pool 'proxies': database unavailable, retrying" in caplog.text


def test_acquire_raises_the_database_error_when_the_outage_outlasts_wait(pool, outage):
    started = time.monotonic()
    with pytest.raises(OperationalError) as caught:
        pool.acquire(ttl=30, wait=0.5)
    assert caught.value is REFUSED and outage.calls >= 2
    assert 0.5 <= time.monotonic() - started < 2


def test_acquire_says_no_resource_when_the_database_answered_last(pool, outage):
    outage.on = False
    pool.acquire(ttl=30)  # the only resource: busy from now on
    outage.on = True
    threading.Timer(0.3, lambda: setattr(outage, "on", False)).start()
    with pytest.raises(NoResourceAvailable, match="within 1s"):
        pool.acquire(ttl=30, wait=1)
    assert outage.calls >= 1


def test_acquire_does_not_wait_out_errors_that_are_not_outages(pool, monkeypatch):
    calls = []

    def broken(work, using=None, attempts=8, **options):
        calls.append(1)
        raise OperationalError(1054, "Unknown column 'busy_before'")

    monkeypatch.setattr(db, "run", broken)
    with pytest.raises(OperationalError, match="Unknown column"):
        pool.acquire(ttl=30, wait=10)
    assert calls == [1]


def test_a_claim_an_outage_hid_is_recognised_on_the_next_attempt(pool, monkeypatch):
    """The claim commits, then the connection dies and stays refused past db.run's retries:
    the next attempt finds the claim instead of leaving the resource busy for its ttl."""
    monkeypatch.setattr(db.time, "sleep", lambda s: None)
    real = Pool._claimer
    made = []

    def claimer(id_, token, holder, ttl):
        claim = real(id_, token, holder, ttl)
        made.append(claim)
        if len(made) > 1:
            return claim
        calls = []

        def committed_then_lost(cursor, resumed):
            calls.append(resumed)
            if len(calls) == 1:
                assert claim(cursor, resumed) == 1  # committed...
                raise OperationalError(2013, "Lost connection to server during query")  # ...reply lost
            raise REFUSED

        return committed_then_lost

    monkeypatch.setattr(Pool, "_claimer", staticmethod(claimer))
    lease = pool.acquire(ttl=30, wait=2)  # the pool's only resource
    assert len(made) == 2
    r = row("a")
    assert (lease.name, lease.token, lease.holder) == ("a", r.token, r.holder)
    assert r.token == 1 and lease.remaining() > 29


def test_release_within_gives_up_while_a_renewal_holds_the_lease(pool):
    lease = pool.acquire(ttl=30)
    with lease._lock:  # as a renewal stuck in a hung database does
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer from the database within 0.3s"):
            release_within(lease, 0.3)
        assert time.monotonic() - started < 1
    # The abandoned attempt carries on in the background and frees the row once it can.
    deadline = time.monotonic() + 5
    while pool.stats()["free"] != 1:
        assert time.monotonic() < deadline, "the abandoned release never finished"
        time.sleep(0.05)
    assert lease.released and release_within(lease, 5) is False


def test_a_second_release_within_waits_for_the_first_to_reach_the_database(pool, monkeypatch):
    """A holder ended by two threads at once (the demo's crawler: its watcher and its main
    thread) releases twice; the second call returned at once, its process exited, and the
    first release, still on its way, was never sent: the demo found proxies held after
    every crawler had stopped politely."""
    lease = pool.acquire(ttl=30)
    run = db.run

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return run(*args, **kwargs)

    monkeypatch.setattr(db, "run", slow)
    first = threading.Thread(target=release_within, args=(lease, 5))
    first.start()
    time.sleep(0.1)  # the first release holds the lease's lock, its statement not yet sent
    assert lease.released and release_within(lease, 5) is False
    assert row("a").holder == "", "returned before the release reached the database"
    first.join()


def test_release_within_sends_nothing_for_a_lease_that_ran_out_locally(pool, monkeypatch):
    lease = pool.acquire(ttl=30)
    monkeypatch.setattr(lease, "_deadline", time.monotonic() - 1)
    monkeypatch.setattr(db, "run", lambda *a, **k: pytest.fail("a release was sent"))
    assert release_within(lease, 5) is False
    monkeypatch.undo()
    assert row("a").holder == lease.holder  # frees itself when the server's clock says so


def test_heartbeat_stop_is_bounded_while_a_renewal_hangs(pool):
    lease = pool.acquire(ttl=30)
    heartbeat = Heartbeat(lease, interval=0.05)
    with lease._lock:  # every renewal blocks
        heartbeat.start()
        time.sleep(0.2)
        started = time.monotonic()
        heartbeat.stop(0.3)
        assert 0.3 <= time.monotonic() - started < 1
        assert heartbeat.is_alive()
    heartbeat.join(5)
    assert not heartbeat.is_alive()
