"""A Scrapy downloader middleware that sends a spider's requests through a leased proxy.

Each spider holds one resource of a pool (a proxy) at a time, so two crawlers never
share a proxy, a crawler that dies frees its proxy within the ttl, and a banned proxy
is quarantined and swapped for another while the request is retried on it::

    DOWNLOADER_MIDDLEWARES = {"leases.contrib.scrapy.LeasesMiddleware": 700}
    LEASES_POOL = "proxies"      # resources whose data is {"url": "http://10.0.0.1:3128"}

Order 700 puts it before Scrapy's HttpProxyMiddleware (750), which turns the userinfo
of `request.meta["proxy"]` into a Proxy-Authorization header. It needs the asyncio
reactor (Scrapy's default). Settings:

- ``LEASES_POOL`` (required; without it the middleware is off): the pool of proxies.
- ``LEASES_TTL`` (60): seconds a proxy of a crawler that died stays out of use.
- ``LEASES_WAIT`` (300): seconds a request waits for a proxy; then the spider closes
  with reason ``leases_no_resource``.
- ``LEASES_FAIR`` (False): serve waiting spiders in the order they came.
- ``LEASES_QUARANTINE`` (1800): seconds a banned proxy stays out of the pool.
- ``LEASES_BAN_POLICY`` (``leases.contrib.scrapy.BanPolicy``): import path of a class
  with ``response_is_ban(request, response)`` and ``exception_is_ban(request,
  exception)``; built with ``from_crawler`` if it has one.
- ``LEASES_BAN_RETRIES`` (5): times a banned request is retried on the next proxy before
  it is dropped (stat ``leases/bans_gave_up``).
- ``LEASES_ROTATE_REQUESTS`` (0, never) and ``LEASES_ROTATE_SECONDS`` (0, never): swap
  the proxy after that many requests or seconds; ``LEASES_ROTATE_COOLDOWN`` (0): seconds
  the proxy rotated out rests before anyone gets it again.
- ``LEASES_PROXY`` (``leases.contrib.scrapy.proxy_url``): import path of a function
  ``(resource_data, lease) -> str`` giving the proxy URL of a resource.
- ``LEASES_TOKEN_HEADER`` (None): a header that carries ``<pool>/<name> <token>`` on each
  request, so the proxy or the site can refuse a holder whose lease has passed on.
- ``LEASES_DATABASE_URL`` (None): for a process with no Django project; Django is set up
  on that database unless it is configured already.
- ``LEASES_HOLDER`` (host:pid): the holder name stored in the lease.

A request whose ``meta`` has ``leases_skip`` or a ``proxy`` of its own is left alone.
Every request sent through a lease carries ``meta["leases"]`` (pool, name, id, token).
Stats: ``leases/acquired``, ``leases/lost``, ``leases/replaced``, ``leases/requests``,
``leases/bans`` (quarantined the current proxy), ``leases/bans_ignored`` (seen through a
proxy already given up), ``leases/bans_gave_up``, ``leases/rotations`` and
``leases/waited_seconds`` (time the spider spent without a proxy).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from scrapy import Request, signals
from scrapy.core.downloader.handlers.http11 import TunnelError
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.misc import load_object
from twisted.internet.error import ConnectError, ConnectionLost
from twisted.internet.error import TimeoutError as UserTimeout
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from ..exceptions import LeaseError, LeaseLost, NoResourceAvailable

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings

    from ..holder import AsyncHolder
    from ..lease import Lease

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds between two looks of a waiting request at whether the spider is closing: a
#: spider stopped while it waits for a proxy must not wait out LEASES_WAIT.
CLOSING_POLL = 0.1
#: Seconds between two looks of a rotation at the requests still running on the proxy.
DRAIN_POLL = 0.02
#: Where the middleware keeps its own mark on a request it counts as in flight.
_IN_FLIGHT = "_leases_in_flight"


class BanPolicy:
    """The default idea of a ban: the site answered 403 or 429, or the proxy could not be
    reached, dropped the connection or refused a tunnel (a dead or blocked proxy is as
    useless as a banned one). Subclass it and name yours in LEASES_BAN_POLICY."""

    statuses = frozenset({403, 429})
    #: ConnectError covers refused connections, TCP timeouts and a proxy host that does
    #: not resolve; ResponseFailed a connection lost before or during the response.
    exceptions: tuple[type[BaseException], ...] = (ConnectError, ConnectionLost, ResponseFailed, TunnelError)
    #: Not bans: DOWNLOAD_TIMEOUT running out (Twisted files it under ConnectError) may
    #: just be a slow site. Take it out of here if your proxies hang rather than refuse.
    excluded: tuple[type[BaseException], ...] = (UserTimeout,)

    def response_is_ban(self, request: Request, response: Response) -> bool:
        return response.status in self.statuses

    def exception_is_ban(self, request: Request, exception: BaseException) -> bool:
        return isinstance(exception, self.exceptions) and not isinstance(exception, self.excluded)


def proxy_url(resource: Any, lease: Lease) -> str:
    """The proxy URL of a resource: its data's ``url`` (or the data, if it is a string),
    with its ``username`` and ``password`` put into the URL's userinfo, which Scrapy's
    HttpProxyMiddleware sends as Proxy-Authorization."""
    if isinstance(resource, str):
        return resource
    url = resource.get("url") if isinstance(resource, dict) else None
    if not isinstance(url, str) or not url:
        raise ValueError(f"the data of {lease.pool}/{lease.name} has no 'url'")
    user, password = resource.get("username"), resource.get("password")
    if user is None:
        return url
    parts = urlsplit(url)
    userinfo = quote(str(user), safe="") + ("" if password is None else ":" + quote(str(password), safe=""))
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc.rpartition('@')[2]}"))


@dataclass(frozen=True)
class Config:
    """The LEASES_* settings, read once (see the module's docstring)."""

    pool: str
    ttl: float = 60
    wait: float = 300
    fair: bool = False
    quarantine: float = 1800
    ban_policy: str = "leases.contrib.scrapy.BanPolicy"
    ban_retries: int = 5
    rotate_requests: int = 0
    rotate_seconds: float = 0
    rotate_cooldown: float = 0
    proxy: str = "leases.contrib.scrapy.proxy_url"
    token_header: str | None = None
    database_url: str | None = None
    holder: str | None = None

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> Config:
        pool = settings.get("LEASES_POOL")
        if not pool:
            raise NotConfigured("LEASES_POOL is not set")
        d = cls(pool=pool)
        return cls(
            pool=pool,
            ttl=settings.getfloat("LEASES_TTL", d.ttl),
            wait=settings.getfloat("LEASES_WAIT", d.wait),
            fair=settings.getbool("LEASES_FAIR", d.fair),
            quarantine=settings.getfloat("LEASES_QUARANTINE", d.quarantine),
            ban_policy=settings.get("LEASES_BAN_POLICY") or d.ban_policy,
            ban_retries=settings.getint("LEASES_BAN_RETRIES", d.ban_retries),
            rotate_requests=settings.getint("LEASES_ROTATE_REQUESTS", d.rotate_requests),
            rotate_seconds=settings.getfloat("LEASES_ROTATE_SECONDS", d.rotate_seconds),
            rotate_cooldown=settings.getfloat("LEASES_ROTATE_COOLDOWN", d.rotate_cooldown),
            proxy=settings.get("LEASES_PROXY") or d.proxy,
            token_header=settings.get("LEASES_TOKEN_HEADER") or None,
            database_url=settings.get("LEASES_DATABASE_URL") or None,
            holder=settings.get("LEASES_HOLDER") or None,
        )


def setup_django(database_url: str | None) -> None:
    """Make the leases models usable: a process with no Django project is set up on
    `database_url`; one that has a project keeps it (`leases.configure` decides)."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from ..setup import configure

    if not database_url and not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ImproperlyConfigured("leases.contrib.scrapy: set LEASES_DATABASE_URL (or configure Django)")
    configure(database_url=database_url or "")


def build(path: str, crawler: Crawler) -> Any:
    """An instance of the class at `path`, through its `from_crawler` if it has one."""
    cls = load_object(path)
    return cls.from_crawler(crawler) if hasattr(cls, "from_crawler") else cls()


def same(tag: dict | None, lease: Lease | None) -> bool:
    """Whether a request's tag names this very holding (the resource row and its token)."""
    return tag is not None and lease is not None and (tag["id"], tag["token"]) == (lease.id, lease.token)


def where(lease: Lease) -> str:
    return f"{lease.pool}/{lease.name} (token {lease.token})"


Key = tuple[int, int]


def key_of(lease: Lease) -> Key:
    """A holding: the slot's row and its token (a new acquisition of the row has a new one)."""
    return (lease.id, lease.token)


class LeasesMiddleware:
    """Holds one resource of LEASES_POOL for the spider and routes its requests through it.

    The lease is taken when the spider opens (requests wait for it), kept alive and
    re-taken after a loss by an AsyncHolder, whose database work runs on its own thread,
    and released when the spider closes or the engine stops. While a holding is being
    given up (a ban, a rotation) new requests wait for the next one.
    """

    def __init__(self, crawler: Crawler, config: Config) -> None:
        self.crawler, self.config = crawler, config
        setup_django(config.database_url)
        from ..pool import Pool

        self.pool = Pool(config.pool)
        self.policy = build(config.ban_policy, crawler)
        self.proxy_of: Callable[[Any, Lease], str] = load_object(config.proxy)
        self.holder: AsyncHolder | None = None
        self._first: asyncio.Future | None = None  # the first acquisition, which requests wait for
        self._replacing: tuple[Key, asyncio.Future, dict] | None = None  # holding given up, task, how
        self._in_flight: Counter[Key] = Counter()  # requests out, by holding
        self._use: tuple[Key, int, float] | None = None  # (holding, requests sent, first sent at)
        self._proxy: tuple[Key, str] | None = None
        self._closing = False
        self._closed = False
        self._waiting_since: float | None = None
        self._keep: set[Any] = set()  # our Deferreds, which must not be collected before they fire

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> LeasesMiddleware:
        mw = cls(crawler, Config.from_settings(crawler.settings))
        crawler.signals.connect(mw.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(mw.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(mw.engine_stopped, signal=signals.engine_stopped)
        return mw

    @property
    def stats(self) -> Any:
        return self.crawler.stats

    # -- the holder ---------------------------------------------------------------

    def spider_opened(self, spider: Any = None) -> None:
        """Start acquiring at once, so the first requests wait less (never blocks)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no asyncio loop running: the first request starts it
        self._start()

    def _start(self) -> AsyncHolder:
        """The holder, made and told to acquire the first time it is needed."""
        if self.holder is None:
            from ..holder import AsyncHolder

            c = self.config
            self.holder = AsyncHolder(self.pool, ttl=c.ttl, wait=c.wait, fair=c.fair, holder=c.holder,
                                      on_acquired=self._acquired, on_lost=self._lost,
                                      on_replaced=self._replaced)
            log.info("leases: waiting up to %gs for a resource of pool %r", c.wait, c.pool)
            self._first = asyncio.ensure_future(self.holder.acquire(wait=c.wait))
            self._first.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by requests
        return self.holder

    # The holder logs acquisitions and losses itself; these count them.
    def _acquired(self, lease: Lease) -> None:
        self.stats.inc_value("leases/acquired")

    def _lost(self, lease: Lease) -> None:
        self.stats.inc_value("leases/lost")

    def _replaced(self, old: Lease, new: Lease) -> None:
        self.stats.inc_value("leases/replaced")
        log.info("leases: %s replaced by %s", where(old), where(new))

    # Coroutines, not Deferreds: Scrapy awaits them on the reactor's asyncio loop (and
    # deprecates Deferreds from signal handlers since 2.14).
    async def spider_closed(self, spider: Any = None, reason: str = "") -> None:
        await self.close()

    async def engine_stopped(self) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop waiting and release the lease; never blocks the reactor (idempotent)."""
        self._closing = True  # requests waiting for a lease stop waiting
        holder = self.holder
        if holder is None or self._closed:
            return
        self._closed = True
        lease, held = holder.lease, holder.held
        await holder.aclose()  # ends an acquisition or replacement still waiting, too
        if self._replacing is not None and not self._replacing[1].done():
            self._replacing[1].cancel()
        if lease is not None:
            log.info("leases: %s %s", "released" if held else "let go of", where(lease))

    # -- waiting for a lease -------------------------------------------------------

    def _engine(self) -> Any:
        """The crawler's engine; None before the crawl starts (Scrapy 2.14+ raises then)."""
        try:
            return self.crawler.engine
        except (AttributeError, RuntimeError):
            return None

    def _stopping(self) -> bool:
        """Whether the spider is closing (or stopping), so waiting requests should end."""
        if self._closing:
            return True
        engine = self._engine()
        if engine is None:
            return False  # not crawling through an engine: a test drives the middleware
        if not getattr(self.crawler, "crawling", True):
            return True
        slot = getattr(engine, "_slot", None) or getattr(engine, "slot", None)
        return slot is not None and getattr(slot, "closing", None) is not None

    async def _until(self, awaitable: Awaitable[T], deadline: float, shared: bool) -> T:
        """Await `awaitable` until `deadline` (NoResourceAvailable), or IgnoreRequest as
        soon as the spider is closing. A `shared` future is left running for the others."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=max(0.0, min(CLOSING_POLL, deadline - time.monotonic())))
                if task.done():
                    break
                if self._stopping():
                    raise IgnoreRequest("the spider is closing")
                if time.monotonic() >= deadline:
                    raise NoResourceAvailable(f"none held within {self.config.wait:g}s")
            if task.cancelled():  # only close() cancels
                raise IgnoreRequest("the spider is closing")
            return task.result()
        finally:
            if not shared and not task.done():
                task.cancel()

    def _ready(self, holder: AsyncHolder) -> Lease | None:
        """The lease a request may use now: held, and not being given up."""
        first = self._first
        if first is None or not first.done() or first.cancelled() or first.exception() is not None:
            return None
        if self._replacing is not None and not self._replacing[1].done():
            return None
        return holder.lease if holder.held else None

    def _change(self, holder: AsyncHolder) -> tuple[Awaitable[Any], bool]:
        """What a request without a usable lease waits for, and whether others share it."""
        first = self._first
        if first is not None and (not first.done() or first.cancelled() or first.exception() is not None):
            return first, True  # done with an error: awaiting it raises the error
        if self._replacing is not None and not self._replacing[1].done():
            return self._replacing[1], True
        return holder.wait_held(), False

    async def _lease(self) -> Lease:
        """The lease to send a request through, waiting up to LEASES_WAIT for one."""
        if self._stopping():
            raise IgnoreRequest("the spider is closing")
        holder = self._start()
        lease = self._ready(holder)
        if lease is not None:
            return lease
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        deadline = time.monotonic() + self.config.wait
        try:
            while (lease := self._ready(holder)) is None:
                awaitable, shared = self._change(holder)
                await self._until(awaitable, deadline, shared)
        except IgnoreRequest:
            raise
        except Exception as exc:
            self._give_up(exc)
            raise IgnoreRequest(f"no resource of pool {self.config.pool!r}") from None
        if self._waiting_since is not None:
            waited, self._waiting_since = time.monotonic() - self._waiting_since, None
            self.stats.inc_value("leases/waited_seconds", round(waited, 3))
            if waited >= 1:
                log.info("leases: waited %.1fs for %s", waited, where(lease))
        return lease

    def _give_up(self, exc: BaseException) -> None:
        """No resource came in time, or the pool cannot be used: close the spider, once.
        Sending requests without a proxy instead is no option (nor is waiting forever)."""
        if self._closing:
            return
        self._closing = True
        reason = "leases_no_resource" if isinstance(exc, LeaseError) else "leases_error"
        log.error("leases: giving up on pool %r: %s; closing the spider (%s)", self.config.pool,
                  str(exc).splitlines()[0] if str(exc) else type(exc).__name__, reason)
        engine = self._engine()
        if engine is None:
            return
        if hasattr(engine, "close_spider_async"):
            closing = deferred_from_coro(engine.close_spider_async(reason=reason))
        else:  # Scrapy before 2.14
            closing = engine.close_spider(self.crawler.spider, reason)
        self._keep.add(closing)

        def closed(result: Any) -> None:
            self._keep.discard(closing)
            if isinstance(result, Failure):
                log.error("leases: closing the spider failed: %s", result.getErrorMessage())

        closing.addBoth(closed)

    # -- requests ----------------------------------------------------------------------

    async def process_request(self, request: Request, spider: Any = None) -> None:
        """Wait for the lease and send the request through its proxy, tagged with it."""
        meta = request.meta
        if meta.get("leases_skip") or ("proxy" in meta and "leases" not in meta):
            return None
        while True:  # a resource whose data gives no proxy URL is quarantined: try the next
            lease = await self._maybe_rotate(await self._lease())
            url = self._proxy_url(lease)
            if url is not None:
                self._tag(request, lease, url)
                return None

    def _proxy_url(self, lease: Lease) -> str | None:
        """The lease's proxy URL; None if its data gives none (and it is given up)."""
        if self._proxy is None or self._proxy[0] != key_of(lease):
            try:
                self._proxy = (key_of(lease), self.proxy_of(lease.resource, lease))
            except Exception as exc:  # the user's function: any failure means unusable data
                log.error("leases: no proxy URL for %s (%s); quarantining it", where(lease), exc)
                reason = f"bad resource data: {exc}"
                self._replace_soon(lease, quarantine=self.config.quarantine, reason=reason)
                return None
        return self._proxy[1]

    def _tag(self, request: Request, lease: Lease, url: str) -> None:
        key = key_of(lease)
        request.meta["leases"] = {"pool": lease.pool, "name": lease.name, "id": lease.id,
                                  "token": lease.token}
        request.meta["proxy"] = url
        request.meta[_IN_FLIGHT] = True
        if self.config.token_header:
            request.headers[self.config.token_header] = f"{lease.pool}/{lease.name} {lease.token}"
        self._in_flight[key] += 1
        _, count, since = self._use if self._use and self._use[0] == key else (key, 0, time.monotonic())
        self._use = (key, count + 1, since)
        self.stats.inc_value("leases/requests")

    def _done(self, request: Request) -> dict | None:
        """The request's lease tag, and it no longer counts as in flight on that holding."""
        tag = request.meta.get("leases")
        if tag is not None and request.meta.pop(_IN_FLIGHT, False):
            key = (tag["id"], tag["token"])
            self._in_flight[key] -= 1
            if self._in_flight[key] <= 0:
                del self._in_flight[key]
        return tag

    async def process_response(self, request: Request, response: Response,
                               spider: Any = None) -> Response | Request:
        tag = self._done(request)
        if tag is None or not self.policy.response_is_ban(request, response):
            return response
        return self._banned(request, tag, f"{response.status} {request.url}")

    async def process_exception(self, request: Request, exception: Exception,
                                spider: Any = None) -> Request | None:
        tag = self._done(request)
        if tag is None or not self.policy.exception_is_ban(request, exception):
            return None
        return self._banned(request, tag, f"{type(exception).__name__} {request.url}")

    # -- bans and rotation -----------------------------------------------------------

    def _banned(self, request: Request, tag: dict, what: str) -> Request:
        """Quarantine the holding the ban was seen through, if it is still ours, and retry
        the request on the next resource. A ban seen through an older holding says
        nothing about the current one, so it only costs the request a retry."""
        lease = self.holder.lease if self.holder is not None else None
        name = f"{tag['pool']}/{tag['name']} (token {tag['token']})"
        if lease is not None and same(tag, lease):
            self.stats.inc_value("leases/bans")
            log.warning("leases: ban on %s: %s; quarantining it for %gs", name, what, self.config.quarantine)
            self._replace_soon(lease, quarantine=self.config.quarantine, reason=f"ban: {what}")
        else:
            self.stats.inc_value("leases/bans_ignored")
            log.info("leases: ban seen through %s, no longer the current holding: %s", name, what)
        return self._retry(request, what)

    def _retry(self, request: Request, what: str) -> Request:
        """A copy of a banned request for the next resource; IgnoreRequest after
        LEASES_BAN_RETRIES retries."""
        retries = request.meta.get("leases_ban_retries", 0)
        if retries >= self.config.ban_retries:
            self.stats.inc_value("leases/bans_gave_up")
            log.warning("leases: giving up on %s after %d retries on other resources (%s)",
                        request.url, retries, what)
            raise IgnoreRequest(f"banned {retries + 1} times: {what}")
        meta = {k: v for k, v in request.meta.items() if k not in ("leases", "proxy", _IN_FLIGHT)}
        meta["leases_ban_retries"] = retries + 1
        retry = request.replace(meta=meta, dont_filter=True)
        if self.config.token_header:
            retry.headers.pop(self.config.token_header, None)
        return retry

    def _replace_soon(self, lease: Lease, **how: Any) -> None:
        """Start giving `lease` up for the next resource, in the background and once per
        holding; requests wait for it meanwhile. A ban that comes while a rotation waits
        for its requests turns the rotation into a quarantine."""
        key = key_of(lease)
        if self._replacing is not None and self._replacing[0] == key and not self._replacing[1].done():
            self._replacing[2].update(how)
            return
        self._replacing = (key, asyncio.ensure_future(self._replace(lease, how)), how)

    async def _replace(self, lease: Lease, how: dict) -> None:
        if how.pop("drain", False):
            await self._drain(lease, how)
        try:
            await self._start().replace(of=lease, **how)
        except LeaseLost as exc:
            log.info("leases: %s was lost before it could be given up: %s", where(lease), exc)
        except Exception as exc:  # a database error or the pool emptied: nothing to send through
            self._give_up(exc)

    async def _drain(self, lease: Lease, how: dict) -> None:
        """Let the requests out on `lease` finish before it is released, for at most a
        ttl: whoever gets its proxy next must not share it with them. A quarantined
        proxy goes to nobody, so a ban ends the wait."""
        key = key_of(lease)
        deadline = time.monotonic() + min(self.config.ttl, lease.remaining())
        while self._in_flight.get(key) and "quarantine" not in how and not self._stopping():
            if time.monotonic() >= deadline:
                log.warning("leases: rotating %s with %d requests still out", where(lease),
                            self._in_flight[key])
                return
            await asyncio.sleep(DRAIN_POLL)

    def _rotation_due(self, lease: Lease) -> bool:
        if self._use is None or self._use[0] != key_of(lease):
            return False
        _, count, since = self._use
        c = self.config
        return bool((c.rotate_requests and count >= c.rotate_requests)
                    or (c.rotate_seconds and time.monotonic() - since >= c.rotate_seconds))

    async def _maybe_rotate(self, lease: Lease) -> Lease:
        """The lease, or the next one when LEASES_ROTATE_* says it is time to rotate."""
        if not self._rotation_due(lease):
            return lease
        self.stats.inc_value("leases/rotations")
        log.info("leases: rotating out %s after %d requests in %.1fs (resting %gs)", where(lease),
                 self._use[1], time.monotonic() - self._use[2], self.config.rotate_cooldown)
        self._replace_soon(lease, drain=True, cooldown=self.config.rotate_cooldown)
        return await self._lease()
