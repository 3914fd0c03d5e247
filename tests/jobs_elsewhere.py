"""A handler that test workers do not import by default (`--import tests.jobs_elsewhere`
gives it to one), for the hand-off of jobs whose handler a worker lacks."""
from __future__ import annotations

import os

from leases.tasks import handler


@handler("crawl.sitemap", queue="default", max_attempts=3, backoff=0.0)
def sitemap(payload):
    """Return the pid of the process that ran it."""
    return os.getpid()
