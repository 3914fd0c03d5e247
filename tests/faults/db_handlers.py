"""A handler that reads the database, as a pipeline's join reads its tasks' results, for
the fault tests' worker processes (`--import tests.faults.db_handlers`).

It naps first (work before its first statement, a fetch say), then counts jobs through
the ORM on its thread's kept connection, appends "n pid" to the file its payload names,
and returns its thread's id: a test sees which threads ran jobs.
"""
from __future__ import annotations

import os
import threading
import time

from leases.tasks import handler
from leases.tasks.models import Job


@handler("faults.read", queue="default", max_attempts=3, backoff=0.0)
def read(payload: dict) -> int:
    time.sleep(payload.get("nap", 0))
    Job.objects.filter(queue="default", status=Job.SUCCEEDED).count()
    with open(payload["log"], "a") as out:
        out.write(f"{payload['n']} {os.getpid()}\n")
    return threading.get_ident()
