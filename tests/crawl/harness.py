"""What the crawl tests share: spider processes on proxies leased from a pool, the proxies'
logs as the witnesses, and a middleware driven directly on a test's own asyncio loop."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from scrapy.http import HtmlResponse, Request
from scrapy.utils.test import get_crawler

from leases import Pool
from leases.contrib.scrapy import LeasesMiddleware
from leases.models import Resource
from tests.conftest import ROOT, database_url
from tests.crawl.servers import Proxy, Site, read_log

#: Short, so that a killed spider's proxy comes free within the test's time.
TTL = 3
PASSWORD = "s3cret:@/ key"  # needs quoting in a URL's userinfo


class Crawl:
    """Sites, proxies leased from a pool, and spider processes crawling through them."""

    def __init__(self, tmp: Path, pool: str, pages: int = 1000, delay: float = 0.05) -> None:
        self.tmp, self.pool = tmp, pool
        self.site = Site(pages, delay).start()
        self.sites = [self.site]
        self.proxies: list[Proxy] = []
        self.spiders: list[subprocess.Popen] = []

    def add_site(self, **options: object) -> Site:
        """Another site (see `Site`), stopped with the rest."""
        site = Site(**options).start()
        self.sites.append(site)
        return site

    def add_proxies(self, count: int, ban_every: int = 0) -> None:
        """`count` proxies, resources `proxy-0`... of the pool; the first bans if `ban_every`."""
        for i in range(count):
            proxy = Proxy(f"proxy-{i}", self.tmp / f"proxy-{i}.jsonl", ban_every if i == 0 else 0,
                          user=f"user-{i}", password=PASSWORD).start()
            self.proxies.append(proxy)
            data = {"url": proxy.url, "username": f"user-{i}", "password": PASSWORD}
            Pool(self.pool).add(proxy.name, data=data)

    def start(self, pages: int, site: Site | None = None, acquire_delay: float = 0.0,
              **settings: object) -> subprocess.Popen:
        """A spider process crawling `site` (the first) that knows only the database's URL
        (no Django project)."""
        n = len(self.spiders)
        options = {"LEASES_TTL": TTL, "LEASES_WAIT": 50, "LEASES_FAIR": True, "LEASES_QUARANTINE": 600,
                   **settings}
        argv = [sys.executable, "-m", "tests.crawl.spider", "--database-url", database_url(),
                "--pool", self.pool, "--start", f"{(site or self.site).url}/page/0", "--pages", str(pages),
                "--stats", str(self.tmp / f"stats-{n}.json")]
        if acquire_delay:
            argv += ["--acquire-delay", str(acquire_delay)]
        for key, value in options.items():
            argv += ["-s", f"{key}={value}"]
        env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1")
        err = open(self.tmp / f"spider-{n}.log", "w+")  # a file: a full pipe would stall the spider
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        proc.number, proc.err = n, err
        self.spiders.append(proc)
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return (self.tmp / f"spider-{proc.number}.log").read_text()

    def stats(self, proc: subprocess.Popen) -> dict:
        return json.loads((self.tmp / f"stats-{proc.number}.json").read_text())

    def requests(self) -> list[dict]:
        return [entry for proxy in self.proxies for entry in read_log(proxy.log)]

    def finish(self, proc: subprocess.Popen, timeout: float = 50) -> dict:
        """Wait for a spider to end well; its stats."""
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"spider {proc.pid} still running after {timeout}s:\n{self.log(proc)[-3000:]}")
        assert code == 0, self.log(proc)[-3000:]
        return self.stats(proc)

    def held_by(self, proc: subprocess.Popen) -> list[Resource]:
        """The pool's slots whose row names the spider process as their holder."""
        prefix = f"{socket.gethostname()}:{proc.pid}:"
        return list(Resource.objects.filter(pool=self.pool, holder__startswith=prefix))

    def close(self) -> None:
        for proc in self.spiders:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.err.close()
        for server in (*self.sites, *self.proxies):
            server.stop()


def token_of(entry: dict) -> int:
    """The token of an X-Lease header, `<pool>/<name> <token>`."""
    return int(entry["token"].rsplit(" ", 1)[1])


def holdings(entries: list[dict]) -> list[dict]:
    """One proxy's requests by lease token, in the order the holdings began: the token,
    the spider, and when its first request began and its last one ended."""
    by_token: dict[int, dict] = {}
    for e in entries:
        h = by_token.setdefault(token_of(e), {"token": token_of(e), "spiders": set(), "start": e["start"],
                                              "end": e["end"]})
        h["spiders"].add(e["spider"])
        h["start"], h["end"] = min(h["start"], e["start"]), max(h["end"], e["end"])
    return sorted(by_token.values(), key=lambda h: h["start"])


def assert_one_spider_at_a_time(entries: list[dict]) -> None:
    """On each proxy: every request came through a lease on that proxy's resource, a token
    is one spider's, tokens only grow, and a holding's requests all ended before the next
    holding's first began."""
    for name in sorted({e["proxy"] for e in entries}):
        mine = [e for e in entries if e["proxy"] == name]
        assert {e["token"].rsplit(" ", 1)[0] for e in mine} == {f"crawl-proxies/{name}"}
        held = holdings(mine)
        for h in held:
            assert len(h["spiders"]) == 1, f"{name}: token {h['token']} used by spiders {h['spiders']}"
        assert [h["token"] for h in held] == sorted(h["token"] for h in held), f"{name}: tokens went back"
        for before, after in zip(held, held[1:]):
            assert before["end"] <= after["start"], (
                f"{name}: token {before['token']} (spider {before['spiders']}) still in use "
                f"{before['end'] - after['start']:.3f}s after token {after['token']} began")


def middleware(pool: str, **settings: object) -> LeasesMiddleware:
    """The middleware of a crawler that never crawls: a test calls its methods itself."""
    crawler = get_crawler(settings_dict={"LEASES_POOL": pool, "LEASES_TTL": 5, "LEASES_WAIT": 1, **settings})
    return LeasesMiddleware.from_crawler(crawler)


def banned(request: Request, status: int = 403) -> HtmlResponse:
    return HtmlResponse(request.url, status=status, body=b"banned", request=request)


def fetched(request: Request) -> HtmlResponse:
    return HtmlResponse(request.url, status=200, body=b"<html></html>", request=request)
