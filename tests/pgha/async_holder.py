"""An AsyncHolder in a process of its own, for the failover tests.

    python -m tests.pgha.async_holder POOL TTL

Prints the JSON lines of tests.galera.holder (each renewal, and every 0.1 s the lease
held), from an asyncio loop: `remaining` is 0 while the holder does not surely hold it.
Reads "stop" on stdin: closes the holder and exits 0.
"""
from __future__ import annotations

import asyncio
import sys
import threading

from tests.galera.holder import say  # sets Django up and reports each renewal


async def main(pool: str, ttl: float) -> None:
    from leases import AsyncHolder  # once Django is set up

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=commands, daemon=True).start()
    async with AsyncHolder(pool, ttl=ttl, interval=ttl / 4) as holder:
        while not stop.is_set():
            lease = holder.lease
            say(event="state", name=lease.name, token=lease.token, holder=lease.holder,
                remaining=lease.remaining() if holder.held else 0.0, alive=True)
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass
    say(event="stopped")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
