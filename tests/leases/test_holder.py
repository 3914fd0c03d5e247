"""AsyncHolder: a lease held from an event loop that never touches the database itself.

Each test runs its coroutine with asyncio.run, so Django sees an async context there:
any ORM call made on the loop would raise SynchronousOnlyOperation.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from leases import AsyncHolder, LeaseError, NoResourceAvailable, Pool
from leases.models import Resource

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def proxies():
    pool = Pool("proxies")
    pool.add_many([("p1", None), ("p2", None)])
    return pool


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_a_holder_holds_renews_off_the_loop_and_releases(proxies):
    async def crawl():
        async with AsyncHolder("proxies", ttl=1.0, interval=0.25) as holder:
            first = holder.lease
            time.sleep(1.5)  # a callback that hogs the loop longer than the ttl
            assert holder.held and holder.lease is first and first.remaining() > 0
            return first

    lease = run(crawl())
    assert lease.released and proxies.stats()["held"] == 0


def test_callbacks_hear_a_loss_and_wait_held_gives_the_next_lease(proxies):
    heard: list[tuple] = []

    async def lost(lease):  # an async callback is run as a task
        heard.append(("lost", lease.token))

    async def crawl():
        holder = AsyncHolder("proxies", ttl=1.0, interval=0.2, on_lost=lost,
                             on_acquired=lambda lease: heard.append(("acquired", lease.token)))
        first = await holder.acquire()
        await asyncio.to_thread(proxies.release, first.name)  # an operator takes it
        while not any(event == "lost" for event, _ in heard):
            await asyncio.sleep(0.05)
        second = await holder.wait_held(5)
        await holder.aclose()
        return first, second

    first, second = run(crawl())
    assert second is not first and second.released
    assert heard[0] == ("acquired", first.token) and ("lost", first.token) in heard
    assert heard[-1] == ("acquired", second.token)


def test_concurrent_bans_of_one_holding_replace_it_once(proxies):
    replaced: list[tuple] = []

    async def crawl():
        async with AsyncHolder("proxies", ttl=5, on_replaced=lambda old, new: replaced.append((old, new))) as holder:
            banned = holder.lease
            news = await asyncio.gather(*[holder.replace(quarantine=60, reason="ban: HTTP 403", of=banned)
                                          for _ in range(5)])
            late = await holder.replace(quarantine=60, reason="ban: a late 403", of=banned)
            return banned, news, late

    banned, news, late = run(crawl())
    assert len({id(lease) for lease in news}) == 1 and late is news[0] and news[0].name != banned.name
    assert len(replaced) == 1
    reasons = dict(Resource.objects.filter(pool="proxies").values_list("name", "quarantine_reason"))
    assert reasons == {banned.name: "ban: HTTP 403", news[0].name: ""}


def test_an_acquire_that_finds_nothing_within_its_wait_says_so(proxies):
    held = [proxies.acquire(ttl=30) for _ in range(2)]

    async def crawl():
        holder = AsyncHolder("proxies", ttl=5)
        started = time.monotonic()
        with pytest.raises(NoResourceAvailable):
            await holder.acquire(wait=0.5)
        waited = time.monotonic() - started
        await holder.aclose()
        return waited

    assert 0.5 <= run(crawl()) < 2
    assert all(lease.remaining() > 0 for lease in held)


def test_a_cancelled_wait_closes_the_holder_and_leaves_nothing_held(proxies):
    proxies.quarantine("p2", 60)
    held = proxies.acquire(ttl=30)

    async def crawl():
        holder = AsyncHolder("proxies", ttl=5)
        waiting = asyncio.ensure_future(holder.acquire())
        await asyncio.sleep(0.3)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(LeaseError):
            await holder.acquire()
        return holder

    holder = run(crawl())
    held.release()  # free now: a wait still running would take it
    time.sleep(0.5)
    assert holder.lease is None and proxies.stats()["held"] == 0


def test_closing_a_holder_never_used_is_a_no_op(proxies):
    async def crawl():
        holder = AsyncHolder("proxies")
        await holder.aclose()
        await holder.aclose()

    run(crawl())


def test_a_replacement_that_finds_nothing_within_the_wait_says_so_and_seeks_on(proxies):
    async def crawl():
        async with AsyncHolder("proxies", ttl=2, interval=0.3, wait=0.5) as holder:
            first = holder.lease
            other = await asyncio.to_thread(proxies.acquire, ttl=30)  # the only other proxy
            started = time.monotonic()
            with pytest.raises(NoResourceAvailable, match=r"within 0\.\ds"):
                await holder.replace(quarantine=60, reason="ban: 403", of=first)
            waited = time.monotonic() - started
            assert not holder.held
            await asyncio.to_thread(other.release)
            return first, await holder.wait_held(5), waited

    first, second, waited = run(crawl())
    assert waited < 2 and second.name != first.name
