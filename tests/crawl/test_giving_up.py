"""How a spider gives a proxy up (a ban, a rotation, its close) at Scrapy's default
concurrency: never while requests are still out on it, never leaving a lease behind."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

pytest.importorskip("scrapy")

# After the skip: everything below needs Scrapy.
from django.db import connections
from scrapy.http import Request

from leases import NoResourceAvailable, Pool, targets
from leases.models import Resource, ResourceTarget
from tests.conftest import wait_for
from tests.crawl.harness import assert_one_spider_at_a_time, banned, fetched, holdings, middleware

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: Pages each spider asks for: several holdings' worth at five pages a holding.
PAGES = 40


def test_spiders_of_two_sites_share_two_proxies_through_per_site_bans(crawl):
    """Two sites that answer 429 after five requests through one proxy, pages taking 50 to
    500 ms, a spider for each (LEASES_TARGET) at Scrapy's default concurrency, two proxies:
    each ban drains the proxy, then releases it to the other spider, which takes it at once."""
    sites = {target: crawl.add_site(pages=1000, delay=(0.05, 0.5), ban_after=5, ban_for=1.0)
             for target in ("shop", "news")}
    crawl.add_proxies(2)
    spiders = {target: crawl.start(pages=PAGES, site=site, LEASES_TARGET=target, LEASES_QUARANTINE=1)
               for target, site in sites.items()}
    stats = {target: crawl.finish(spider, timeout=150) for target, spider in spiders.items()}

    for target, spider in spiders.items():
        log = crawl.log(spider)
        assert stats[target]["finish_reason"] == "finished", log[-3000:]
        assert "giving up on pool" not in log and "Traceback" not in log, log[-3000:]
        assert stats[target]["leases/bans"] >= 1
    entries = crawl.requests()
    assert_one_spider_at_a_time(entries)
    for target, spider in spiders.items():  # each page asked for was fetched, or dropped after its retries
        pages = {e["url"] for e in entries if e["spider"] == str(spider.pid) and e["status"] == 200}
        assert len(pages) + stats[target].get("leases/bans_gave_up", 0) == stats[target]["pages_asked"]
    passed_on = []
    for name in ("proxy-0", "proxy-1"):
        held = holdings([e for e in entries if e["proxy"] == name])
        passed_on += [before["spiders"] != after["spiders"] for before, after in zip(held, held[1:])]
    assert any(passed_on), "no proxy passed from one spider to the other"
    assert {r.target for r in ResourceTarget.objects.filter(pool=crawl.pool)} == {"shop", "news"}
    assert list(Resource.objects.filter(pool=crawl.pool).exclude(holder="").values("name", "holder")) == []


@pytest.mark.parametrize("when", ["first", "replacement"])
def test_a_spider_stopped_while_it_takes_a_proxy_leaves_none_held(crawl, when):
    """SIGTERM while an acquisition has claimed a proxy but not handed it over yet (each
    one returns 3 s after its claim, as over a slow link): the first acquisition, or the
    replacement of a rotation. The spider's close waits for it and releases the proxy,
    which would otherwise stay held for its ttl (30 s) by a process that is gone."""
    crawl.add_proxies(1)
    spider = crawl.start(pages=1000, acquire_delay=3, LEASES_ROTATE_REQUESTS=10, LEASES_TTL=30)
    tokens = {"first": 1, "replacement": 2}

    def claimed():  # the proxy's row taken by the spider, before the spider hears of it
        return [r for r in crawl.held_by(spider) if r.token >= tokens[when]]

    wait_for(claimed, 40, f"the spider's {when} claim")
    assert f"holding crawl-proxies/proxy-0 (token {tokens[when]})" not in crawl.log(spider)
    spider.send_signal(signal.SIGTERM)
    stats = crawl.finish(spider, timeout=20)
    assert stats["finish_reason"] == "shutdown"
    assert crawl.held_by(spider) == [], crawl.log(spider)[-3000:]
    assert Resource.objects.get(pool=crawl.pool).holder == ""
    assert "Traceback" not in crawl.log(spider)


# -- the middleware driven directly, on an asyncio loop of the test's own ----------------


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def off_loop(function, *args, **kwargs):
    """`function` on a thread of its own, which closes its database connection after."""
    def call():
        try:
            return function(*args, **kwargs)
        finally:
            connections.close_all()

    return await asyncio.to_thread(call)


def holders(pool: str) -> dict[str, str]:
    return dict(Resource.objects.filter(pool=pool).values_list("name", "holder"))


async def until(predicate, what: str) -> None:
    """Poll a blocking `predicate` off the loop until it holds."""
    for _ in range(400):
        if await off_loop(predicate):
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"never: {what}")


@pytest.fixture
def unit():
    """Pool "unit" of proxies a and b, and a spider of another target holding nothing yet."""
    for name in ("a", "b"):
        Pool("unit").add(name, data={"url": f"http://127.0.0.1:9/{name}"})
    return Pool("unit", target="news.example")


def the_other(name: str) -> str:
    return {"a": "b", "b": "a"}[name]


def written(pool: str, name: str, target: str):
    return lambda: name in targets.unusable_now(pool, target, [name])


@pytest.fixture
def gated_ban(monkeypatch):
    """targets.ban held until `go` is set; `writing` is set when it is called."""
    writing, go = threading.Event(), threading.Event()
    ban = targets.ban

    def gated(*args, **kwargs):
        writing.set()
        go.wait(10)
        return ban(*args, **kwargs)

    monkeypatch.setattr(targets, "ban", gated)
    yield writing, go
    go.set()


def test_a_second_ban_while_the_first_is_written_joins_it(unit, gated_ban, caplog):
    """The report's crash: with LEASES_TARGET, a ban arriving while the first ban of the
    holding is being written put `ban` back into the arguments of the replacement
    (TypeError, the spider closed with leases_error, and its next request went out through
    the banned proxy)."""
    writing, go = gated_ban
    mw = middleware("unit", LEASES_TARGET="shop.example", LEASES_QUARANTINE=300)

    async def scenario():
        first, second = Request("http://shop.example/1"), Request("http://shop.example/2")
        await mw.process_request(first)
        await mw.process_request(second)
        await mw.process_response(first, banned(first, 429))
        while not writing.is_set():
            await asyncio.sleep(0.01)
        await mw.process_response(second, banned(second, 429))  # while the first is written
        go.set()
        after = Request("http://shop.example/3")
        await mw.process_request(after)
        await mw.close()
        return first, after

    first, after = run(scenario())
    name = first.meta["leases"]["name"]
    assert after.meta["leases"]["name"] == the_other(name)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert set(targets.unusable_now("unit", "shop.example", ["a", "b"])) == {name}
    assert (mw.crawler.stats.get_value("leases/bans"), mw.crawler.stats.get_value("leases/replaced")) == (2, 1)
    assert holders("unit") == {"a": "", "b": ""}


def probe_taken(other: Pool, name: str) -> bool:
    """Whether the spider of the other target can take the proxy `name` within half a
    second (the spider holds it, and the other proxy is held by that spider already)."""
    try:
        lease = other.acquire(ttl=30, wait=0.5)
    except NoResourceAvailable:
        return False
    assert lease.name == name
    lease.release()
    return True


@pytest.mark.parametrize("rotating", [False, True], ids=["ban", "ban-during-rotation"])
def test_with_a_target_a_banned_proxy_is_released_only_once_its_requests_are_done(unit, rotating):
    """A ban for the target drains the proxy as a rotation does: the other target's spider,
    waiting for a proxy, gets it only once the last request out on it is done. A ban that
    comes while a rotation waits for those requests is written, and the wait goes on."""
    mw = middleware("unit", LEASES_TARGET="shop.example", LEASES_QUARANTINE=300, LEASES_WAIT=10,
                    LEASES_ROTATE_REQUESTS=2 if rotating else 0)

    async def scenario():
        first, second = Request("http://shop.example/1"), Request("http://shop.example/2")
        await mw.process_request(first)
        await mw.process_request(second)
        name = first.meta["leases"]["name"]
        news = await off_loop(unit.acquire, ttl=30)  # the other target's spider holds the other proxy
        assert news.name == the_other(name)
        third = None
        if rotating:  # the next request starts the rotation, and waits for the next proxy
            third = asyncio.ensure_future(mw.process_request(Request("http://shop.example/3")))
            await asyncio.sleep(0.2)
            assert not third.done() and mw.crawler.stats.get_value("leases/rotations") == 1
        await mw.process_response(first, banned(first, 429))
        await until(written("unit", name, "shop.example"), "the ban written")
        assert not await off_loop(probe_taken, unit, name), "released with a request still out on it"
        await mw.process_response(second, fetched(second))  # the last request on it is done
        taken = await off_loop(unit.acquire, ttl=30, wait=5)
        assert taken.name == name
        await off_loop(news.release)  # the spider's target may use it
        after = Request("http://shop.example/4")
        await mw.process_request(after)
        assert after.meta["leases"]["name"] == news.name
        if rotating:
            await third
        await mw.close()
        await off_loop(taken.release)
        return name

    name = run(scenario())
    assert set(targets.unusable_now("unit", "shop.example", ["a", "b"])) == {name}
    assert holders("unit") == {"a": "", "b": ""}
    assert mw.crawler.stats.get_value("leases/replaced") == 1


def test_a_spider_closed_while_a_banned_proxy_drains_writes_the_ban_and_releases_it(unit):
    """Close during the drain: the ban is written, no next proxy is taken for a spider
    that is closing, and close() releases the banned one."""
    mw = middleware("unit", LEASES_TARGET="shop.example", LEASES_QUARANTINE=300)

    async def scenario():
        first, second = Request("http://shop.example/1"), Request("http://shop.example/2")
        await mw.process_request(first)
        await mw.process_request(second)
        await mw.process_response(first, banned(first, 429))
        name = first.meta["leases"]["name"]
        await until(written("unit", name, "shop.example"), "the ban written")
        await mw.close()
        return name

    name = run(scenario())
    assert set(targets.unusable_now("unit", "shop.example", ["a", "b"])) == {name}
    assert holders("unit") == {"a": "", "b": ""}
    assert Resource.objects.get(pool="unit", name=the_other(name)).token == 0  # never taken
    assert mw.crawler.stats.get_value("leases/replaced") is None


@pytest.mark.parametrize("when", ["first", "replacement"])
def test_close_releases_what_an_acquisition_still_running_takes(unit, monkeypatch, when):
    """An acquisition (the first, or a replacement's) that claims a proxy and hands it over
    only after close() began: close waits for it and releases the proxy, so the spider's
    process never ends with a proxy held that nobody knows of."""
    acquire, slow = Pool.acquire, threading.Event()

    def claim_then_stall(self, *args, stop=None, **kwargs):
        lease = acquire(self, *args, stop=stop, **kwargs)
        if slow.is_set():
            stop.wait(10)  # until the holder is told to stop,
            time.sleep(0.3)  # and a little longer: the reply of a slow database
        return lease

    monkeypatch.setattr(Pool, "acquire", claim_then_stall)
    mw = middleware("unit", LEASES_QUARANTINE=300)

    def claimed() -> bool:
        return sum(1 for holder in holders("unit").values() if holder) == 1 and (
            when == "first" or Resource.objects.filter(pool="unit", quarantined_until__isnull=False).exists())

    async def scenario():
        if when == "replacement":
            first = Request("http://shop.example/1")
            await mw.process_request(first)
            slow.set()
            await mw.process_response(first, banned(first))  # quarantined: the next is taken
        else:
            slow.set()
            mw.spider_opened()
        await until(claimed, "a proxy claimed")
        await mw.close()
        return await off_loop(holders, "unit")

    assert run(scenario()) == {"a": "", "b": ""}
