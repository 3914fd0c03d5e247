"""A ResourceThread in a process of its own, for the failover tests.

    python -m tests.galera.holder POOL TTL

Prints JSON lines on stdout: every 0.1 s its state ("state": the lease's name, token,
holder and what remains of it, by its own conservative estimate), and each renewal of
the heartbeat once it returned ("renewed", or "renew-failed" with the error; `began`:
when it was sent). The `t` of each line is time.time(), one clock for every process of
the host. Reads "stop" on stdin: terminate()
and exit 0. Its log (the leases loggers, at LEASES_LOG_LEVEL) goes to stderr.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import django

django.setup()

from leases import ResourceThread  # noqa: E402 - after django.setup()
from leases.lease import Lease  # noqa: E402

_out = threading.Lock()


def say(**facts) -> None:
    with _out:
        print(json.dumps({"t": time.time(), **facts}), flush=True)


_renew = Lease.renew


def renew(self: Lease, ttl: float | None = None) -> None:
    began = time.time()
    try:
        _renew(self, ttl)
    except Exception as exc:
        say(event="renew-failed", began=began, name=self.name, token=self.token,
            error=f"{type(exc).__name__}: {exc}"[:300])
        raise
    say(event="renewed", began=began, name=self.name, token=self.token)


Lease.renew = renew


def main() -> None:
    pool, ttl = sys.argv[1], float(sys.argv[2])
    thread = ResourceThread(pool=pool, ttl=ttl, interval=ttl / 4)
    thread.wait_step = 1.0
    thread.start()
    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    while not stop.wait(0.1):
        lease = thread.lease
        say(event="state", name=lease.name, token=lease.token, holder=lease.holder,
            remaining=lease.remaining(), alive=thread.is_alive())
    thread.terminate()
    say(event="stopped")


if __name__ == "__main__":
    main()
