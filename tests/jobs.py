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
