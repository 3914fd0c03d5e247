"""SQL locks: mutual exclusion across processes, owner-only release, expiry, @synchronized."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from leases import LeaseLost, Locked, break_lock, db, lock, synchronized
from leases.locks import _attempt, acquire_lock
from leases.models import Lock
from tests.conftest import CONTEXT

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_held_lock_refuses_others_with_the_seed_message():
    with lock("rebuild:crawl", ttl=30) as held:
        assert held.token == 1 and held.remaining() > 29
        with pytest.raises(Locked, match=r"^PROCESSING LOCKED: rebuild:crawl \(held by \S+ for (29|30)\.\ds more\)$") as info:
            acquire_lock("rebuild:crawl")
        assert (info.value.name, info.value.holder) == ("rebuild:crawl", held.holder)
        assert 29 < info.value.expires_in <= 30
        started = time.monotonic()
        with pytest.raises(Locked):
            acquire_lock("rebuild:crawl", wait=0.4)
        assert time.monotonic() - started >= 0.4
    with lock("rebuild:crawl") as again:  # released on exit; the row and its token stay
        assert again.token == 2
    assert Lock.objects.get(name="rebuild:crawl").holder == ""


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": ""}, "lock name must be a non-empty string"),
        ({"name": "x" * 256}, "lock name is longer than 255"),
        ({"name": "x", "ttl": 0}, "ttl must be"),
        ({"name": "x", "wait": -1}, "wait must be"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        acquire_lock(**kwargs)
    assert not Lock.objects.exists()


def test_leaving_the_block_after_the_lock_expired_raises_lease_lost():
    with pytest.raises(LeaseLost, match=r"^lock x \(token 1\) expired or was broken inside its block: someone"):
        with lock("x", ttl=0.2):
            time.sleep(0.4)
            other = acquire_lock("x")  # and someone else took it meanwhile
    assert Lock.objects.get(name="x").holder == other.holder  # theirs, untouched
    with pytest.raises(LeaseLost):
        with lock("y", ttl=30):
            break_lock("y")


def test_an_error_inside_the_block_wins_over_the_expiry_which_is_logged(caplog):
    with pytest.raises(KeyError):
        with lock("x", ttl=0.2):
            time.sleep(0.4)
            acquire_lock("x")
            raise KeyError("the block's own error")
    assert "lock x (token 1) expired or was broken inside its block" in caplog.text


def test_a_lock_that_expired_but_was_taken_by_no_one_leaves_quietly():
    with lock("x", ttl=0.2) as held:
        time.sleep(0.4)  # the token did not move: no one else held it meanwhile
    assert held.released and Lock.objects.get(name="x").holder == ""


def test_a_lock_released_inside_its_block_leaves_quietly():
    with lock("x", ttl=30) as held:
        assert held.release() is True
        assert acquire_lock("x").token == 2


def test_keep_alive_renews_the_lock_past_its_ttl():
    with lock("x", ttl=0.3, keep_alive=True) as held:
        time.sleep(1.0)  # more than three ttls
        with pytest.raises(Locked):
            acquire_lock("x")
        assert held.remaining() > 0
    assert acquire_lock("x").token == 2  # released on exit


def test_keep_alive_reports_a_lock_broken_by_an_operator_on_exit():
    with pytest.raises(LeaseLost):
        with lock("x", ttl=0.6, keep_alive=True) as held:
            assert break_lock("x")
            time.sleep(0.5)  # the next renewal finds it gone
            assert held.lost


def test_extend_moves_the_expiry_and_fails_once_expired():
    held = acquire_lock("x", ttl=0.3)
    held.extend(ttl=0.6)
    time.sleep(0.4)  # past the first ttl, within the extension
    held.extend(ttl=0.3)
    time.sleep(0.5)
    with pytest.raises(LeaseLost, match="lock x .* expired or passed to another holder"):
        held.extend()
    assert held.release() is False


def test_a_stale_owner_can_neither_release_nor_extend_the_new_owners_lock():
    stale = acquire_lock("x", ttl=0.3)
    time.sleep(0.5)
    fresh = acquire_lock("x", ttl=30)
    assert fresh.token == stale.token + 1
    assert stale.release() is False  # the original's blind DEL would have freed it here
    with pytest.raises(LeaseLost):
        stale.extend()
    row = Lock.objects.get(name="x")
    assert (row.holder, row.token) == (fresh.holder, fresh.token)
    with pytest.raises(Locked):
        acquire_lock("x")


def test_break_lock_frees_it_and_the_holder_cannot_extend():
    held = acquire_lock("x", ttl=30)
    assert break_lock("x") is True
    assert break_lock("x") is False
    with pytest.raises(LeaseLost):
        held.extend()
    assert acquire_lock("x").token == held.token + 2


def test_a_claim_that_committed_before_the_connection_dropped_is_recognised():
    acquire_lock("x", ttl=0.2)
    time.sleep(0.3)
    attempt = _attempt("x", 30, "me:1:abcd", "default")
    first = db.run(attempt)
    assert first is not None and first.token == 2
    # The reply was lost: the retry finds its own claim instead of waiting for itself.
    again = db.run(lambda cursor, resumed: attempt(cursor, True))
    assert again is not None and again.token == 2 and again.remaining() > 29
    other = _attempt("x", 30, "other:2:ef01", "default")
    busy = db.run(lambda cursor, resumed: other(cursor, True))  # held: by whom and how long
    assert busy.holder == "me:1:abcd" and 29 < busy.left <= 30


def _contend(seconds, occupancy, lock_, out):
    got, overlaps = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with lock("shared", ttl=30, wait=1) as held:
                with lock_:
                    occupancy.value += 1
                    overlaps += occupancy.value > 1
                time.sleep(random.uniform(0, 0.003))
                with lock_:
                    occupancy.value -= 1
                got.append(held.token)
        except Locked:
            pass
    out.put((got, overlaps))


@pytest.mark.slow
def test_mutual_exclusion_across_processes(processes, queue):
    occupancy, guard = CONTEXT.Value("i", 0), CONTEXT.Lock()
    for _ in range(6):
        processes.start(_contend, 2.5, occupancy, guard, queue)
    results = [queue.get(timeout=60) for _ in range(6)]
    processes.join_all()
    tokens = sorted(t for got, _ in results for t in got)
    assert sum(o for _, o in results) == 0
    assert len(tokens) > 20
    assert tokens == list(range(1, len(tokens) + 1))  # each holder its own, growing token


def _hold_and_hang(ttl, out):
    before = time.monotonic()
    held = acquire_lock("x", ttl=ttl)
    out.put((before, held.token))
    time.sleep(3600)


@pytest.mark.slow
def test_a_sigkilled_holders_lock_frees_itself_after_ttl(processes, queue):
    child = processes.start(_hold_and_hang, 1.5, queue)
    before, token = queue.get(timeout=30)
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(Locked):
        acquire_lock("x")
    held = acquire_lock("x", wait=10)
    assert time.monotonic() - before >= 1.5
    assert time.monotonic() - before < 1.5 + 3
    assert held.token == token + 1


@synchronized("dispatch:", arg=0, ttl=30)
def rebuild(name, log=None):
    return f"rebuilt {name}"


@synchronized("dispatch:", arg="name", ttl=30)
def rebuild_by_name(size, name):
    return f"rebuilt {name}"


@synchronized("global-rebuild", ttl=30)
def rebuild_everything():
    return "rebuilt all"


def _call_rebuild(out):
    for call in (lambda: rebuild("crawl"), lambda: rebuild_by_name(3, name="crawl"),
                 lambda: rebuild("other"), rebuild_everything):
        try:
            out.put(call())
        except Locked as exc:
            out.put(str(exc).split(" (held by ")[0])


def test_synchronized_refuses_while_its_key_is_held_in_another_process(processes, queue):
    with lock("dispatch:crawl", ttl=30), lock("global-rebuild", ttl=30):
        processes.start(_call_rebuild, queue)
        answers = [queue.get(timeout=30) for _ in range(4)]
    assert answers == [
        "PROCESSING LOCKED: dispatch:crawl",
        "PROCESSING LOCKED: dispatch:crawl",
        "rebuilt other",
        "PROCESSING LOCKED: global-rebuild",
    ]
    assert rebuild("crawl") == "rebuilt crawl"  # free again once released
    assert rebuild_by_name(1, "crawl") == "rebuilt crawl"
