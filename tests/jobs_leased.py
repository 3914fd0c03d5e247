"""Handlers of jobs that hold resources, for worker processes (`--import tests.jobs_leased`).

Each run appends "resource token start end target pid n" to the file its payload names
(monotonic times, one clock for every process of the host), so a test can check that no
resource served two jobs at once and that tokens only grew, without trusting the
database it checks.
"""
from __future__ import annotations

import os
import time

from leases.tasks import Needs, handler


def _site(payload):
    return payload["site"]


def _run(payload, ctx) -> str:
    began = time.monotonic()
    if payload.get("ban_on") == ctx.lease.name:
        ctx.ban(f"403 from {payload['site']}", seconds=payload.get("ban_for", 600))
    time.sleep(payload.get("seconds", 0.0))
    if payload.get("log"):
        with open(payload["log"], "a") as out:
            out.write(f"{ctx.lease.name} {ctx.lease.token} {began:.6f} {time.monotonic():.6f} {ctx.target}"
                      f" {os.getpid()} {payload['n']}\n")
    return ctx.lease.name


@handler("leased.fetch", queue="default", max_attempts=5, backoff=0.0, lease=Needs("crawlpool", target=_site))
def fetch(payload, ctx):
    return _run(payload, ctx)


@handler("leased.paced", queue="default", max_attempts=5, backoff=0.0,
         lease=Needs("crawlpool", target=_site, pace=0.3))
def paced(payload, ctx):
    return _run(payload, ctx)


@handler("leased.plain", queue="default", max_attempts=3, backoff=0.0)
def plain(payload):
    if payload.get("log"):
        with open(payload["log"], "a") as out:
            out.write(f"plain {payload['n']} {time.monotonic():.6f}\n")
