"""Handlers the queue tests push to; workers load them with ``--import tests.jobs``.

Each run appends "job-id attempt pid" to the file named in the payload, so a test can
count runs across processes without a shared database connection.
"""
from __future__ import annotations

import os
import time

from leases.tasks import Fail, handler


def _record(payload: dict) -> None:
    if payload.get("log"):
        with open(payload["log"], "a") as out:
            out.write(f"{payload.get('n')} {os.getpid()}\n")


@handler("noop", queue="default", max_attempts=3, backoff=0.0)
def noop(payload):
    _record(payload)


@handler("sleepy", queue="default", max_attempts=2, backoff=0.0)
def sleepy(payload):
    time.sleep(payload.get("seconds", 1))
    _record(payload)
    return payload.get("n")


@handler("boom", queue="default", max_attempts=3, backoff=0.0)
def boom(payload):
    _record(payload)
    raise RuntimeError(f"boom {payload.get('n')}")


@handler("refuse", queue="default", max_attempts=5)
def refuse(payload):
    raise Fail("bad payload")


@handler("slow", queue="default", max_attempts=2, backoff=0.0, timeout=0.3)
def slow(payload):
    time.sleep(payload.get("seconds", 2))


@handler("echo", queue="other", max_attempts=1)
def echo(payload):
    return {"echo": payload}


def _window(payload: dict, name: str) -> None:
    """Append "key start end pid" (monotonic, one clock for every process of the host)."""
    began = time.monotonic()
    time.sleep(payload.get("seconds", 0.2))
    if payload.get("log"):
        with open(payload["log"], "a") as out:
            out.write(f"{payload['key']} {began:.6f} {time.monotonic():.6f} {os.getpid()}\n")


@handler("limited", queue="default", max_attempts=3, limit_key=lambda payload: payload["key"], concurrency=2)
def limited(payload):
    """At most two of a key at once, across every worker."""
    _window(payload, "limited")


@handler("rated", queue="default", max_attempts=3, limit_key=lambda payload: payload["key"], rate="5/s")
def rated(payload):
    """At most five starts of a key per second."""
    _window(payload, "rated")


def _where(payload: dict) -> dict:
    """The log and the nap of a job, however it came: pushed or scheduled (its payload),
    or a pipeline's task (its run's context)."""
    return payload.get("context", payload)


@handler("limit.one", queue="default", max_attempts=3, backoff=0.0, limit_key="one", concurrency=1)
def limit_one(payload):
    """One at a time across every worker, whoever enqueued it."""
    where = _where(payload)
    _window({"key": "one", "log": where.get("log"), "seconds": where.get("seconds", 0.2)}, "limit.one")


@handler("limit.rated", queue="default", max_attempts=3, backoff=0.0, limit_key="rated", rate="2/s")
def limit_rated(payload):
    """Two starts a second across every worker, whoever enqueued it."""


@handler("limit.by_site", queue="default", max_attempts=3, backoff=0.0,
         limit_key=lambda payload: payload["item"]["site"], concurrency=1)
def limit_by_site(payload):
    """One at a time per site: the key is a function of what the handler receives (here a
    pipeline's item)."""
    where = _where(payload)
    _window({"key": payload["item"]["site"], "log": where.get("log"), "seconds": where.get("seconds", 0.2)}, "site")
