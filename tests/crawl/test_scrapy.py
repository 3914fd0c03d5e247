"""The Scrapy middleware with real Scrapy: spider processes on proxies leased from a pool.

The proxies are the witnesses. Each logs every request with its time, the spider's pid
(X-Spider) and the lease token (X-Lease), so the tests judge what the spiders did from
the outside: no two spiders on one proxy at once, a killed spider's proxy passed on
within its ttl, a ban quarantining only the holding it was seen through.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from datetime import datetime

import pytest

pytest.importorskip("scrapy")

# After the skip: everything below needs Scrapy.
from django.db import connections
from django.utils import timezone
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import HtmlResponse, Request
from scrapy.settings import Settings
from twisted.internet import error

from leases import Pool, targets
from leases.contrib.scrapy import BanPolicy, Config, proxy_url
from leases.models import Resource, Waiter
from tests.conftest import wait_for
from tests.crawl.harness import PASSWORD, TTL, assert_one_spider_at_a_time, banned, middleware, token_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_six_spiders_share_four_proxies_through_a_ban_and_a_kill(crawl):
    crawl.add_proxies(4, ban_every=10)
    spiders = [crawl.start(pages=300) for _ in range(6)]
    # Every spider is after a proxy, and one not on the banning proxy is well into its crawl.
    wait_for(lambda: all("leases: waiting up to" in crawl.log(s) for s in spiders), 40, "six spiders asking")

    def busy_victim():
        entries = crawl.requests()
        banned_side = {e["spider"] for e in entries if e["proxy"] == "proxy-0"}
        for s in spiders:
            mine = [e for e in entries if e["spider"] == str(s.pid)]
            if len(mine) >= 20 and str(s.pid) not in banned_side:
                return s, mine[-1]["proxy"], token_of(mine[-1])
        return None

    victim, victims_proxy, victims_token = wait_for(busy_victim, 40, "a spider 20 requests into its crawl")
    victim.kill()
    killed_at = time.time()
    victim.wait(5)

    stats = [crawl.finish(s) for s in spiders if s is not victim]
    entries = crawl.requests()
    assert {e["status"] for e in entries} <= {200, 403}
    assert all(e["user"] == e["proxy"].replace("proxy", "user") for e in entries)  # Proxy-Authorization
    assert_one_spider_at_a_time(entries)

    # The killed spider's proxy passed to another spider within its ttl (and a second).
    after = [e for e in entries if e["proxy"] == victims_proxy and e["start"] > killed_at
             and token_of(e) != victims_token]
    assert after, f"{victims_proxy} was never used again after the kill"
    assert min(e["start"] for e in after) - killed_at <= TTL + 1
    assert min(token_of(e) for e in after) > victims_token

    # The ban quarantined the banning proxy, and only it.
    rows = {r.name: r for r in Resource.objects.filter(pool=crawl.pool)}
    assert rows["proxy-0"].quarantined_until > timezone.now()
    assert rows["proxy-0"].quarantine_reason.startswith("ban: 403 http://127.0.0.1:")
    assert [n for n, r in rows.items() if r.quarantined_until and n != "proxy-0"] == []
    assert sum(s.get("leases/bans", 0) for s in stats) >= 1
    assert [s["finish_reason"] for s in stats] == ["finished"] * 5
    assert sum(s["leases/requests"] for s in stats) >= 5 * 300
    wait_for(lambda: Pool(crawl.pool).stats()["held"] == 0, TTL + 2, "every proxy released")


def test_a_spider_waiting_for_a_proxy_stops_at_sigterm_without_waiting_it_out_or_gives_up(crawl):
    crawl.add_proxies(1)
    holder = crawl.start(pages=100_000, CONCURRENT_REQUESTS=4)  # only keeps the proxy busy: a light load
    wait_for(lambda: len(crawl.requests()) >= 5, 40, "the first spider crawling")
    waiting = crawl.start(pages=100)
    wait_for(lambda: Waiter.objects.filter(pool=crawl.pool).exists(), 40, "the second spider in line")

    sent = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    stats = crawl.finish(waiting, timeout=10)
    # It would wait 50 s for the proxy: gone within a few, the wait was cut short (its log
    # shows the close in the second of the signal; the rest is the interpreter's exit, past
    # a second once on CI's busy cores).
    assert time.monotonic() - sent < 5.0, crawl.log(waiting)[-2000:]
    closing = [line[:19] for line in crawl.log(waiting).splitlines()
               if "Received SIGTERM" in line or "Spider closed" in line]
    took = datetime.fromisoformat(closing[-1]) - datetime.fromisoformat(closing[0])
    assert len(closing) == 2 and took.total_seconds() <= 1, closing
    assert stats["finish_reason"] == "shutdown"
    assert str(waiting.pid) not in {e["spider"] for e in crawl.requests()}
    assert "Traceback" not in crawl.log(waiting)

    # One that may wait a second only gives up, and says why.
    impatient = crawl.start(pages=100, LEASES_WAIT=1)
    stats = crawl.finish(impatient, timeout=30)
    assert stats["finish_reason"] == "leases_no_resource"
    assert crawl.log(impatient).count("leases: giving up on pool 'crawl-proxies'") == 1
    assert "Traceback" not in crawl.log(impatient)

    holder.send_signal(signal.SIGTERM)
    stats = crawl.finish(holder, timeout=10)
    assert stats["finish_reason"] == "shutdown"
    assert Pool(crawl.pool).stats()["held"] == 0  # released on the way out, not left to expire
    assert "Traceback" not in crawl.log(holder)


def test_rotation_lets_the_requests_on_the_old_holding_finish_first(crawl):
    crawl.add_proxies(1)
    spider = crawl.start(pages=80, LEASES_ROTATE_REQUESTS=10, CONCURRENT_REQUESTS=8)
    stats = crawl.finish(spider)
    entries = crawl.requests()
    assert_one_spider_at_a_time(entries)  # one proxy, re-leased at each rotation: a new token
    assert len({token_of(e) for e in entries}) >= 6
    assert stats["leases/rotations"] >= 6
    assert stats["finish_reason"] == "finished"


# -- the middleware driven directly, on an asyncio loop of the test's own ----------------


def test_a_ban_seen_through_an_older_holding_quarantines_nothing():
    for name in ("a", "b"):
        Pool("unit").add(name, data={"url": f"http://127.0.0.1:9/{name}"})
    mw = middleware("unit")

    async def scenario():
        old = Request("http://example.com/1")
        await mw.process_request(old)
        await mw.holder.replace(of=mw.holder.lease)  # a rotation: the first holding is over
        new = Request("http://example.com/2")
        await mw.process_request(new)
        retry = await mw.process_response(old, banned(old))
        await mw.close()
        return old, new, retry

    old, new, retry = asyncio.run(scenario())
    assert (new.meta["leases"]["name"], new.meta["leases"]["token"]) != (old.meta["leases"]["name"],
                                                                         old.meta["leases"]["token"])
    assert mw.crawler.stats.get_value("leases/bans_ignored") == 1
    assert mw.crawler.stats.get_value("leases/bans") is None
    assert not Resource.objects.filter(pool="unit", quarantined_until__isnull=False).exists()
    # The request is still retried, on whatever resource is current then.
    assert retry.url == old.url and retry.dont_filter and retry.meta["leases_ban_retries"] == 1
    assert "leases" not in retry.meta and "proxy" not in retry.meta


def test_a_ban_quarantines_the_current_holding_and_retries_until_it_gives_up():
    for name in ("a", "b"):
        Pool("unit").add(name, data={"url": f"http://127.0.0.1:9/{name}"})
    mw = middleware("unit", LEASES_BAN_RETRIES=1, LEASES_QUARANTINE=300)

    def quarantined() -> int:  # on a thread of asyncio's, whose connection it closes
        try:
            return Resource.objects.filter(pool="unit", quarantined_until__isnull=False).count()
        finally:
            connections.close_all()

    async def scenario():
        first = Request("http://example.com/1")
        await mw.process_request(first)
        retry = await mw.process_response(first, banned(first))
        await mw.process_request(retry)  # waits for the first quarantine and the next resource
        assert retry.meta["leases"]["name"] != first.meta["leases"]["name"]
        try:
            with pytest.raises(IgnoreRequest, match="banned 2 times"):  # a dead proxy counts as banned
                await mw.process_exception(retry, error.ConnectionRefusedError())
            while await asyncio.to_thread(quarantined) < 2:  # the second is given up in the background
                await asyncio.sleep(0.05)
        finally:
            await mw.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))
    rows = Resource.objects.filter(pool="unit")
    assert all(r.quarantined_until > timezone.now() for r in rows)
    assert sorted(r.quarantine_reason for r in rows) == ["ban: 403 http://example.com/1",
                                                         "ban: ConnectionRefusedError http://example.com/1"]
    assert mw.crawler.stats.get_value("leases/bans") == 2
    assert mw.crawler.stats.get_value("leases/bans_gave_up") == 1


def test_with_a_target_a_ban_is_that_targets_only_and_shared_with_jobs():
    """LEASES_TARGET: the ban of a proxy is recorded for the spider's target (the rows jobs
    of the queue read too), the proxy stays out of quarantine for everyone else, and this
    spider's next proxy is one its target does not refuse."""
    for name in ("a", "b"):
        Pool("unit").add(name, data={"url": f"http://127.0.0.1:9/{name}"})
    mw = middleware("unit", LEASES_TARGET="shop.example", LEASES_QUARANTINE=300)

    async def scenario():
        first = Request("http://shop.example/1")
        await mw.process_request(first)
        retry = await mw.process_response(first, banned(first))
        await mw.process_request(retry)
        await mw.close()
        return first, retry

    first, retry = asyncio.run(asyncio.wait_for(scenario(), 20))
    banned_name = first.meta["leases"]["name"]
    assert retry.meta["leases"]["name"] != banned_name
    assert not Resource.objects.filter(pool="unit", quarantined_until__isnull=False).exists()
    assert set(targets.unusable_now("unit", "shop.example", ["a", "b"])) == {banned_name}
    assert not targets.unusable_now("unit", "other.example", ["a", "b"])
    assert Pool("unit", target="shop.example").acquire(ttl=5).name != banned_name  # its acquirers too
    assert mw.crawler.stats.get_value("leases/bans") == 1
    (said,) = targets.history("default", pool="unit")  # the log names the spider's holding: host:pid:random
    assert (said.name, said.target, said.kind) == (banned_name, "shop.example", "ban")
    assert said.holder.startswith(f"{socket.gethostname()}:{os.getpid()}:")


@pytest.mark.django_db(transaction=False)
def test_settings_and_proxy_urls():
    with pytest.raises(NotConfigured):
        Config.from_settings(Settings({}))
    config = Config.from_settings(Settings({"LEASES_POOL": "p", "LEASES_TTL": "7", "LEASES_FAIR": "True"}))
    assert (config.pool, config.ttl, config.fair, config.wait) == ("p", 7.0, True, 300)
    assert (config.quarantine, config.ban_retries, config.rotate_requests) == (1800, 5, 0)

    class Lease:
        pool, name = "p", "x"

    assert proxy_url("http://10.0.0.1:3128", Lease) == "http://10.0.0.1:3128"
    assert proxy_url({"url": "http://10.0.0.1:3128"}, Lease) == "http://10.0.0.1:3128"
    assert (proxy_url({"url": "http://old@10.0.0.1:3128", "username": "me", "password": PASSWORD}, Lease)
            == "http://me:s3cret%3A%40%2F%20key@10.0.0.1:3128")
    with pytest.raises(ValueError, match="p/x has no 'url'"):
        proxy_url({"host": "10.0.0.1"}, Lease)

    policy, request = BanPolicy(), Request("http://example.com/")
    statuses = (403, 429, 404, 200)
    assert [policy.response_is_ban(request, HtmlResponse(request.url, status=s)) for s in statuses] \
        == [True, True, False, False]
    assert policy.exception_is_ban(request, error.ConnectionRefusedError())
    assert policy.exception_is_ban(request, error.TCPTimedOutError())
    assert not policy.exception_is_ban(request, error.TimeoutError())  # a slow site: no verdict on the proxy
