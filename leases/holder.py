"""AsyncHolder: hold one resource of a pool from asyncio code (a crawler's event loop).

Django's ORM refuses to run in an async context (SynchronousOnlyOperation), and a loop
that blocks on the database stalls every request in flight. So the holder keeps the
database off the loop: a ResourceThread renews the lease and takes another after a loss
on its own thread and connection, and each acquisition, replacement and release runs on a
short-lived thread of its own that closes its connection when done. The loop only awaits
their outcome and hears of changes through callbacks.

Renewal does not depend on the loop: a callback that hogs the loop for seconds cannot
make the lease run out.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any, Callable

from django.db import connections

from .exceptions import LeaseError, NoResourceAvailable
from .lease import Lease
from .pool import Pool
from .thread import ResourceThread, same_holding

log = logging.getLogger("leases")

Callback = Callable[..., Any]


class _Engine(ResourceThread):
    """The holder's ResourceThread: tells the holder's loop what changed."""

    def __init__(self, owner: AsyncHolder, **options: Any) -> None:
        super().__init__(**options)
        self._owner = owner

    def on_acquired(self, lease: Lease) -> None:
        self._owner._from_thread("acquired", lease)

    def on_lost(self, lease: Lease) -> None:
        self._owner._from_thread("lost", lease)

    def on_replaced(self, old: Lease, new: Lease) -> None:
        self._owner._from_thread("replaced", old, new)


class AsyncHolder:
    """One resource of `pool` (a name or a Pool) held for an asyncio program:
    `async with AsyncHolder("proxies", ttl=30) as holder:`, then `holder.lease`.
    Options: `ttl`, `interval` (default ttl/3), `wait` (how long `acquire()` waits by
    default; None: as long as it takes), `fair` and `holder` (see `Pool.acquire`).

    `lease` is the current lease (None before the first); `held` says whether it is
    surely still ours. After a loss the holder takes another by itself, waiting as long
    as it takes; `wait_held()` waits for it. Callbacks (plain or async functions) run on
    the loop: `on_acquired(lease)`, `on_lost(lease)`, `on_replaced(old, new)`.
    """

    def __init__(self, pool: str | Pool, *, ttl: float = 60, wait: float | None = None, fair: bool = False,
                 holder: str | None = None, interval: float | None = None, on_acquired: Callback | None = None,
                 on_lost: Callback | None = None, on_replaced: Callback | None = None) -> None:
        self.pool = pool if isinstance(pool, Pool) else Pool(pool)
        self.wait = wait
        self._engine = _Engine(self, pool=self.pool, ttl=ttl, interval=interval, holder=holder, fair=fair)
        self._callbacks = {"acquired": on_acquired, "lost": on_lost, "replaced": on_replaced}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: asyncio.Event | None = None
        self._acquiring: asyncio.Future | None = None
        self._replacing: tuple[Lease, asyncio.Future] | None = None
        self._told: asyncio.Queue = asyncio.Queue()
        self._telling: asyncio.Task | None = None
        self._working: set[asyncio.Future] = set()  # outcomes of threads still running
        self._closed = False

    def __repr__(self) -> str:
        return f"<AsyncHolder {self.pool.name} {self.lease!r}>"

    @property
    def lease(self) -> Lease | None:
        """The current lease: None before the first, the lost one until the next is held."""
        return self._engine.lease

    @property
    def held(self) -> bool:
        """Whether a lease is held and surely still ours."""
        lease = self.lease
        return lease is not None and self._held is not None and self._held.is_set() and lease.remaining() > 0

    async def __aenter__(self) -> AsyncHolder:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def acquire(self, wait: float | None = None) -> Lease:
        """The first lease: waits up to `wait` seconds (default the holder's; None for as
        long as it takes), then NoResourceAvailable. Concurrent calls share one wait.
        Cancelling the call closes the holder, so no lease is left held."""
        self._bind()
        if self.lease is not None:
            return await self.wait_held(wait)
        if self._acquiring is None:
            timeout = self.wait if wait is None else wait
            self._acquiring = self._off_loop(self._engine.start, timeout)
        try:
            await asyncio.shield(self._acquiring)
        except asyncio.CancelledError:
            self._close_soon()
            raise
        except NoResourceAvailable:
            self._acquiring = None  # the next call waits anew
            raise
        return self._current()

    async def wait_held(self, timeout: float | None = None) -> Lease:
        """The lease once one is held (at once if it is): after a loss, the next one.
        NoResourceAvailable if none is held within `timeout` seconds."""
        self._bind()
        if self.lease is None:
            return await self.acquire(timeout)
        try:
            await asyncio.wait_for(self._held.wait(), timeout)
        except asyncio.TimeoutError:
            raise NoResourceAvailable(f"no resource of pool {self.pool.name!r} held within {timeout:g}s") from None
        return self._current()

    async def replace(self, *, quarantine: float | None = None, reason: str = "", cooldown: float | None = None,
                      of: Lease | None = None) -> Lease:
        """Give up the current lease and take another at once (see ResourceThread.replace):
        quarantined for `quarantine` seconds with `reason`, else released to rest `cooldown`
        seconds. With `of`, only if the current lease is still that holding; calls for
        one holding share one replacement, and later ones get the lease now held.
        NoResourceAvailable if none is held within the holder's `wait`; the holder goes
        on seeking one, as after a loss."""
        self._bind()
        current = self.lease
        if current is None:
            return await self.acquire()
        if of is not None and not same_holding(current, of):
            return await self.wait_held(self.wait)
        if self._replacing is not None and same_holding(self._replacing[0], current):
            future = self._replacing[1]
        else:
            self._held.clear()
            future = self._off_loop(self._engine.replace, quarantine, reason, cooldown, current, self.wait)
            self._replacing = (current, future)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            self._close_soon()
            raise
        return self._current()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Release the lease and stop, within about `timeout` seconds whatever the database
        does (a lease not released frees itself after its ttl); the loop never blocks.

        An acquisition or replacement still running on its thread is waited for too: a
        lease it takes as the holder closes is released there, and a process that ended
        before that would leave it held, by nobody that knows, for its ttl."""
        if self._loop is None:
            self._closed = True
            return  # never used: nothing is held
        deadline = self._loop.time() + timeout + 1
        if not self._closed:
            self._closed = True
            try:
                await asyncio.wait_for(asyncio.shield(self._off_loop(self._engine.terminate, timeout)),
                                       timeout + 1)
            except Exception as exc:  # closing must not fail the caller (a timeout included)
                log.warning("holder of pool %r: closing took too long or failed: %s", self.pool.name, exc)
        if self._working:
            done, late = await asyncio.wait(set(self._working), timeout=max(0.0, deadline - self._loop.time()))
            for future in done:
                future.cancelled() or future.exception()  # read: its caller may be gone
            if late:
                log.warning("holder of pool %r: %d of its threads still running after %gs; a lease they "
                            "hold frees itself after its ttl", self.pool.name, len(late), timeout + 1)

    # -- between the loop and the threads ------------------------------------------

    def _bind(self) -> None:
        """Remember the running loop: the threads report to it."""
        if self._closed:
            raise LeaseError(f"the holder of pool {self.pool.name!r} is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._held = loop, asyncio.Event()
        elif self._loop is not loop:
            raise LeaseError("an AsyncHolder serves the event loop it was first used on")

    def _current(self) -> Lease:
        lease = self.lease
        if lease is None or self._closed:
            raise LeaseError(f"the holder of pool {self.pool.name!r} was closed while waiting")
        return lease

    def _off_loop(self, function: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run `function` on a thread of its own, which closes its connection when done."""
        loop = self._loop or asyncio.get_running_loop()
        future = loop.create_future()
        self._working.add(future)
        future.add_done_callback(self._working.discard)

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run() -> None:
            result, error = None, None
            try:
                result = function(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                error = exc
            finally:
                connections.close_all()
            self._call_soon(settle, result, error)

        threading.Thread(target=run, name=f"{self.pool.name}: {function.__name__}", daemon=True).start()
        return future

    def _close_soon(self) -> None:
        """A caller gave up waiting: end the wait and release whatever it brings."""
        if not self._closed:
            self._closed = True
            threading.Thread(target=self._engine.terminate, name=f"{self.pool.name}: terminate", daemon=True).start()

    def _call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    def _from_thread(self, event: str, *leases: Lease) -> None:
        if self._loop is not None:
            self._call_soon(self._deliver, event, leases)

    def _deliver(self, event: str, leases: tuple[Lease, ...]) -> None:
        """On the loop: update `held` at once, then queue the caller's callback."""
        if event == "lost":
            self._held.clear()
        elif not self._closed:
            self._held.set()
        callback = self._callbacks[event]
        if callback is not None:
            self._told.put_nowait((event, callback, leases))
            if self._telling is None or self._telling.done():
                self._telling = asyncio.ensure_future(self._tell())

    async def _tell(self) -> None:
        """Call the callbacks one at a time, in the order of the events, awaiting the
        async ones; a callback's failure is a log line, never the holder's."""
        while not self._told.empty():
            event, callback, leases = self._told.get_nowait()
            try:
                outcome = callback(*leases)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception as exc:
                log.warning("holder of pool %r: on_%s raised %s", self.pool.name, event, exc)
