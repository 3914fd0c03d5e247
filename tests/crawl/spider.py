"""The crawl tests' spider: crawls the test site through proxies leased from a pool.

It runs in a fresh process that knows nothing but the database (no Django project)::

    python -m tests.crawl.spider --database-url sqlite:////tmp/db.sqlite3 --pool proxies \\
        --start http://127.0.0.1:8000/page/0 --pages 100 --stats /tmp/stats.json [-s KEY=VALUE ...]

or ``scrapy runspider tests/crawl/spider.py -a start=URL -a pages=100 -s LEASES_POOL=proxies
-s LEASES_DATABASE_URL=...``. Each request carries ``X-Spider: <pid>`` so the proxies'
logs tell the spiders apart.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import scrapy
from scrapy.crawler import CrawlerProcess
from scrapy.http import Response
from scrapy.settings import Settings


class SiteSpider(scrapy.Spider):
    """Follows the site's links until it has asked for `pages` distinct pages."""

    name = "leases_site"
    custom_settings = {
        "DOWNLOADER_MIDDLEWARES": {"leases.contrib.scrapy.LeasesMiddleware": 700},
        "LEASES_TOKEN_HEADER": "X-Lease",
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "DOWNLOAD_TIMEOUT": 10,
    }

    def __init__(self, start: str = "", pages: int | str = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_url, self.pages = start, int(pages)
        self.identity = str(os.getpid())
        self.seen: set[str] = set()

    async def start(self) -> AsyncIterator[scrapy.Request]:
        for request in self.start_requests():
            yield request

    def start_requests(self) -> Iterator[scrapy.Request]:
        yield self.page(self.start_url)

    def page(self, url: str) -> scrapy.Request:
        self.seen.add(url)
        return scrapy.Request(url, headers={"X-Spider": self.identity}, callback=self.parse)

    def parse(self, response: Response) -> Iterator[scrapy.Request]:
        for href in response.css("a::attr(href)").getall():
            url = response.urljoin(href)
            if len(self.seen) >= self.pages:
                return
            if url not in self.seen:
                yield self.page(url)


def settings_from(pairs: list[str]) -> dict[str, str]:
    """-s KEY=VALUE options as a dict."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"-s wants KEY=VALUE, not {pair!r}")
        settings[key] = value
    return settings


def slow_acquisitions(database_url: str, delay: float) -> None:
    """Make each acquisition return `delay` seconds after its claim committed, as over a
    slow link to the database: a spider stopped meanwhile has a lease it was not told of."""
    import leases

    leases.configure(database_url=database_url)  # the middleware finds Django set up
    from leases.pool import Pool

    acquire = Pool.acquire

    def slow(self: Pool, *args: Any, **kwargs: Any) -> Any:
        lease = acquire(self, *args, **kwargs)
        time.sleep(delay)
        return lease

    Pool.acquire = slow


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Crawl the test site through leased proxies.")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--start", required=True, help="the URL of the first page")
    parser.add_argument("--pages", type=int, default=100)
    parser.add_argument("--stats", type=Path, help="write the crawl's stats here as JSON when it ends")
    parser.add_argument("--acquire-delay", type=float, default=0.0,
                        help="seconds each acquisition takes after its claim committed (a slow database)")
    parser.add_argument("-s", dest="settings", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.acquire_delay:
        slow_acquisitions(args.database_url, args.acquire_delay)
    settings = Settings({"LEASES_POOL": args.pool, "LEASES_DATABASE_URL": args.database_url,
                         "LOG_LEVEL": "INFO"})
    settings.setdict(settings_from(args.settings), priority="cmdline")  # over the spider's, as `scrapy -s` is
    process = CrawlerProcess(settings)
    crawler = process.create_crawler(SiteSpider)
    process.crawl(crawler, start=args.start, pages=args.pages)
    process.start()
    if args.stats:
        stats = {"pid": os.getpid(), "pages_asked": len(crawler.spider.seen), **crawler.stats.get_stats()}
        args.stats.write_text(json.dumps(stats, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
