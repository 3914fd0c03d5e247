"""Handlers for the worker process tests; workers load them with ``--import tests.jobs_proc``.

The environment of the worker process shapes an attempt, so one job can behave one way
in the worker a test stops or kills and another way in the worker that takes over:
``JOBS_PROC_NAP`` overrides the seconds slept, ``JOBS_PROC_ROLE`` names the worker.
"""
from __future__ import annotations

import os
import time

from leases.tasks import handler


@handler("nap", queue="default", max_attempts=3, backoff=0.0)
def nap(payload):
    """Sleep, log "n pid", then fail if the payload says so for this worker's role, else
    return the pid, so a test can tell which process wrote the outcome."""
    time.sleep(float(os.environ.get("JOBS_PROC_NAP", payload.get("seconds", 1))))
    if payload.get("log"):
        with open(payload["log"], "a") as out:
            out.write(f"{payload.get('n')} {os.getpid()}\n")
    if payload.get("fail_in") and payload["fail_in"] == os.environ.get("JOBS_PROC_ROLE"):
        raise RuntimeError(f"late failure in {os.getpid()}")
    return {"pid": os.getpid()}
