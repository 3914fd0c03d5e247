"""The handler of bench/scale.py, in a module of its own so the bench's `manage.py
leases_worker` processes import it (`--import bench.scale_handlers`) without running the
bench: a 5 ms crawl of one site, holding one resource of the bench's pool.
"""
from __future__ import annotations

import time
from typing import Any

from leases.tasks import Needs
from leases.tasks.registry import handler

QUEUE, POOL, SECONDS = "bench-scale", "bench-scale", 0.005


def _site(payload: Any) -> str:
    return payload["site"]


@handler("bench.scale.crawl", queue=QUEUE, max_attempts=3, backoff=0.0, lease=Needs(POOL, target=_site))
def crawl(payload: Any) -> None:
    time.sleep(SECONDS)
