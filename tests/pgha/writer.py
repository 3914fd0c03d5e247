"""A client that commits one job after another and says which commits it saw succeed.

    python -m tests.pgha.writer QUEUE

Pushes jobs to QUEUE (which no worker serves) back to back and prints a JSON line
for each: {"event": "acked", "id": ..., "began": ..., "t": ...} once push() returned (so
the commit was acknowledged), or "push-failed" with the error. After a failover every
acknowledged id must be on the new primary (with synchronous replication; asynchronous
replication may lose the last ones). Reads "stop" on stdin and exits 0.
"""
from __future__ import annotations

import sys
import threading
import time

from tests.galera.holder import say  # sets Django up


def main(queue: str) -> None:
    from django.db import DatabaseError, connections

    from leases.tasks import handler, push

    handler("pgha.acked", queue=queue)(lambda payload: None)  # makes the queue known here

    stop = threading.Event()

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    n = 0
    while not stop.is_set():
        began = time.time()
        try:
            job = push("pgha.acked", {"n": n})
        except DatabaseError as exc:  # an outage longer than push's retries: go on
            say(event="push-failed", began=began, error=f"{type(exc).__name__}: {exc}"[:300])
            connections.close_all()
            time.sleep(0.2)
            continue
        say(event="acked", id=job.id, began=began)
        n += 1
        time.sleep(0.02)
    say(event="stopped")


if __name__ == "__main__":
    main(sys.argv[1])
