"""The middleware itself: one proxy held per spider, requests routed through it, bans and
rotations swapping it (see the package's docstring for its settings)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import Request, signals
from scrapy.exceptions import IgnoreRequest
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.misc import load_object
from twisted.python.failure import Failure

from ...exceptions import LeaseError, LeaseLost, NoResourceAvailable
from .config import Config, build, setup_django

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response

    from ...holder import AsyncHolder
    from ...lease import Lease

log = logging.getLogger("leases.contrib.scrapy")
T = TypeVar("T")

#: Seconds between two looks of a waiting request at whether the spider is closing: a
#: spider stopped while it waits for a proxy must not wait out LEASES_WAIT.
CLOSING_POLL = 0.1
#: Seconds between two looks of a rotation at the requests still running on the proxy.
DRAIN_POLL = 0.02
#: Where the middleware keeps its own mark on a request it counts as in flight.
_IN_FLIGHT = "_leases_in_flight"


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
        from ...pool import Pool

        self.pool = Pool(config.pool, target=config.target)
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
            from ...holder import AsyncHolder

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
        if lease is not None and same(tag, lease) and self.config.target:
            self.stats.inc_value("leases/bans")
            log.warning("leases: ban on %s: %s; banning it for target %r for %gs", name, what, self.config.target,
                        self.config.quarantine)
            self._replace_soon(lease, ban=f"ban: {what}")
        elif lease is not None and same(tag, lease):
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
        reason = how.pop("ban", None)
        if reason is not None:  # the target's only: recorded, then the proxy is swapped as a rotation is
            from ... import targets  # after Django is set up (setup_django)

            c = self.config
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: targets.ban(c.pool, lease.name, c.target, c.quarantine, reason, self.pool.using))
            except Exception as exc:  # noqa: BLE001 - the swap still happens; the ban is lost
                log.warning("leases: could not record the ban of %s for %r: %s", where(lease), c.target, exc)
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
        while self._in_flight.get(key) and not {"quarantine", "ban"} & set(how) and not self._stopping():
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
