"""The middleware itself: one proxy held per spider, requests routed through it, bans and
rotations swapping it (see the package's docstring for its settings)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from scrapy import Request, signals
from scrapy.exceptions import IgnoreRequest
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.misc import load_object
from twisted.python.failure import Failure

from ...exceptions import LeaseError, LeaseLost, NoResourceAvailable
from .config import Config, build, setup_django
from .handover import Handover, Key, key_of, where

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
#: Seconds between two looks of a hand-over at the requests still out on the proxy.
DRAIN_POLL = 0.02
#: Seconds close() waits for a hand-over still writing the target's ban.
CLOSE_WAIT = 5.0


def tag_key(tag: dict) -> Key:
    """The holding a request's tag names (the resource row and its token)."""
    return (tag["id"], tag["token"])


class LeasesMiddleware:
    """Holds one resource of LEASES_POOL for the spider and routes its requests through it.

    The lease is taken when the spider opens (requests wait for it), kept alive and
    re-taken after a loss by an AsyncHolder, whose database work runs on its own thread,
    and released when the spider closes or the engine stops. While a holding is being
    given up (a ban, a rotation: a `Handover`) new requests wait for the next one, and it
    is released only once the requests out on it are done.
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
        self._handover: Handover | None = None  # the latest holding given up
        self._out: dict[Key, set[Request]] = {}  # requests out, by holding
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
        """Stop waiting and release every lease the holder took; never blocks the reactor
        (idempotent). Scrapy closes a spider once its requests are done, so the proxy is
        released with none out on it."""
        self._closing = True  # requests waiting for a lease stop waiting
        holder = self.holder
        if holder is None or self._closed:
            return
        self._closed = True
        lease, held = holder.lease, holder.held
        await holder.aclose()  # and what an acquisition or replacement still running takes
        handover = self._handover
        if handover is not None and handover.pending():  # a target's ban being written
            await asyncio.wait({handover.task}, timeout=CLOSE_WAIT)
            handover.task.cancel()
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
        """The lease a request may use now: held, and not given up."""
        first = self._first
        if first is None or not first.done() or first.cancelled() or first.exception() is not None:
            return None
        lease = holder.lease if holder.held else None
        if lease is None or self._given_up(key_of(lease)):
            return None
        return lease

    def _given_up(self, key: Key) -> bool:
        return self._handover is not None and self._handover.key == key

    def _change(self, holder: AsyncHolder) -> tuple[Awaitable[Any], bool]:
        """What a request without a usable lease waits for, and whether others share it."""
        first = self._first
        if first is not None and (not first.done() or first.cancelled() or first.exception() is not None):
            return first, True  # done with an error: awaiting it raises the error
        if self._handover is not None and self._handover.pending():
            return self._handover.task, True
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
                if self._stopping():  # a holding given up as the spider closes stays until close()
                    raise IgnoreRequest("the spider is closing")
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
                self._hand_over(lease, quarantine=(self.config.quarantine, f"bad resource data: {exc}"))
                return None
        return self._proxy[1]

    def _tag(self, request: Request, lease: Lease, url: str) -> None:
        key = key_of(lease)
        request.meta["leases"] = {"pool": lease.pool, "name": lease.name, "id": lease.id,
                                  "token": lease.token}
        request.meta["proxy"] = url
        if self.config.token_header:
            request.headers[self.config.token_header] = f"{lease.pool}/{lease.name} {lease.token}"
        self._out.setdefault(key, set()).add(request)
        _, count, since = self._use if self._use and self._use[0] == key else (key, 0, time.monotonic())
        self._use = (key, count + 1, since)
        self.stats.inc_value("leases/requests")

    def _done(self, request: Request) -> dict | None:
        """The request's lease tag, and it is no longer out on that holding."""
        tag = request.meta.get("leases")
        if tag is not None:
            self._forget(tag_key(tag), {request})
        return tag

    def _forget(self, key: Key, requests: set[Request]) -> None:
        out = self._out.get(key)
        if out is not None:
            out -= requests
            if not out:
                del self._out[key]

    def _out_on(self, key: Key) -> int:
        """How many requests are out on a holding. One the downloader no longer has ended
        without reaching this middleware (one after it answered or replaced it): not out."""
        out = self._out.get(key)
        downloader = getattr(self._engine(), "downloader", None)
        active = getattr(downloader, "active", None)
        if out and isinstance(active, set):
            self._forget(key, {r for r in out if r not in active})
        return len(self._out.get(key, ()))

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
        """Give up the holding the ban was seen through, if it is still ours (banned for the
        target, else quarantined), and retry the request on the next resource. A ban seen
        through a holding already given up says nothing about the current one, so it only
        costs the request a retry."""
        lease = self.holder.lease if self.holder is not None else None
        key, handover, target = tag_key(tag), self._handover, self.config.target
        name = f"{tag['pool']}/{tag['name']} (token {tag['token']})"
        joins = handover is not None and handover.key == key
        if lease is None or key_of(lease) != key or (joins and not handover.open()):
            self.stats.inc_value("leases/bans_ignored")
            log.info("leases: ban seen through %s, no longer the current holding: %s", name, what)
            return self._retry(request, what)
        self.stats.inc_value("leases/bans")
        if joins and (handover.ban if target else handover.quarantine) is not None:
            log.info("leases: another ban on %s: %s", name, what)
        elif target:
            log.warning("leases: ban on %s: %s; banning it for target %r for %gs and giving it up once its "
                        "requests are done", name, what, target, self.config.quarantine)
        else:
            log.warning("leases: ban on %s: %s; quarantining it for %gs", name, what, self.config.quarantine)
        if target:
            self._hand_over(lease, ban=f"ban: {what}")
        else:
            self._hand_over(lease, quarantine=(self.config.quarantine, f"ban: {what}"))
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
        meta = {k: v for k, v in request.meta.items() if k not in ("leases", "proxy")}
        meta["leases_ban_retries"] = retries + 1
        retry = request.replace(meta=meta, dont_filter=True)
        if self.config.token_header:
            retry.headers.pop(self.config.token_header, None)
        return retry

    # -- giving a holding up ---------------------------------------------------------

    def _hand_over(self, lease: Lease, **verdict: Any) -> None:
        """Give `lease` up in the background, once per holding (see `Handover` for the
        verdicts); a verdict on a holding already being given up joins its hand-over."""
        handover = self._handover
        if handover is None or handover.key != key_of(lease):
            handover = self._handover = Handover(lease)
            handover.add(**verdict)
            handover.task = asyncio.ensure_future(self._give_back(handover))
        else:
            handover.add(**verdict)

    async def _give_back(self, handover: Handover) -> None:
        """Settle the hand-over's verdict (writing the target's ban, waiting for the requests
        out on the proxy), then have the holder release or quarantine it and take the next."""
        await self._settle(handover)
        if handover.quarantine is None and self._stopping():
            return  # close() releases it, once Scrapy has no request left out
        handover.commit()
        lease = handover.lease
        try:
            if handover.quarantine is not None:
                seconds, reason = handover.quarantine
                await self._start().replace(of=lease, quarantine=seconds, reason=reason)
            else:
                await self._start().replace(of=lease, cooldown=handover.cooldown)
        except LeaseLost as exc:
            log.info("leases: %s was lost before it could be given up: %s", where(lease), exc)
        except Exception as exc:  # a database error or the pool emptied: nothing to send through
            self._give_up(exc)

    async def _settle(self, handover: Handover) -> None:
        """Write the target's ban, and (unless the proxy is quarantined: it goes to nobody)
        wait until no request is out on it, so that its next holder never shares it with
        them. They end within DOWNLOAD_TIMEOUT, when Scrapy cancels them; the lease stays
        renewed meanwhile. The wait ends early if the lease is lost (it is no longer ours to
        release) or the spider closes (close() releases it when the requests are done)."""
        written, started, said = False, time.monotonic(), False
        while True:
            if handover.ban is not None and not written:
                written = True
                await self._write_ban(handover.lease, handover.ban)
                continue  # a quarantine may have come meanwhile
            out = self._out_on(handover.key)
            if handover.quarantine is not None or not out or self._stopping() or not self._ours(handover.lease):
                return
            if not said and time.monotonic() - started >= self.config.ttl:
                said = True
                log.warning("leases: %d requests still out on %s after %.0fs; it is released when they end",
                            out, where(handover.lease), time.monotonic() - started)
            await asyncio.sleep(DRAIN_POLL)

    def _ours(self, lease: Lease) -> bool:
        """Whether `lease` is still the holder's and surely not passed on."""
        current = self.holder.lease if self.holder is not None else None
        return current is not None and key_of(current) == key_of(lease) and lease.remaining() > 0

    async def _write_ban(self, lease: Lease, reason: str) -> None:
        """Record the ban of `lease`'s resource for the spider's target (not holder-checked:
        the site's verdict holds whoever has the proxy)."""
        from django.db import connections

        from ... import targets  # after Django is set up (setup_django)

        c = self.config

        def write() -> None:
            try:
                targets.ban(c.pool, lease.name, c.target, c.quarantine, reason, self.pool.using,
                            holder=lease.holder)
            finally:
                connections.close_all()  # this executor thread's own

        try:
            await asyncio.get_running_loop().run_in_executor(None, write)
        except Exception as exc:  # noqa: BLE001 - the proxy is still given up; the ban is lost
            log.warning("leases: could not record the ban of %s for %r: %s", where(lease), c.target, exc)

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
        self._hand_over(lease, cooldown=self.config.rotate_cooldown)
        return await self._lease()
