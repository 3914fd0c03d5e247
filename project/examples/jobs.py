"""The job queue: handlers, pushes (dedupe key, priority, delay, retries) and a burst worker.

Three handlers on the queue "example-jobs": one that succeeds, one that refuses its payload
with ``Fail`` (failed at once, no retries), and one whose first attempt fails and is
retried after its backoff. The jobs are pushed, then run by a worker in this process with
``burst=True``, which returns once nothing is ready; a job delayed by an hour stays
waiting. In production the worker is ``manage.py leases_worker --queue example-jobs
--import <module with the handlers>``, in as many processes as you like.

Run it from the checkout::

    python -m project.examples.jobs

With DATABASE_URL unset it works on db.sqlite3 in the checkout (set DATABASE_URL to use
another database); it applies the migrations first, uses only the queue "example-jobs",
and deletes its rows at the end, so it can run again and again. The worker's warnings
about failed attempts go to stderr; LEASES_LOG_LEVEL=INFO shows its every step.
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("LEASES_LOG_LEVEL", "WARNING")
django.setup()  # before importing anything that touches the app's models

from django.core.management import call_command  # noqa: E402

from leases.tasks import Fail, JobWorker, handler, push  # noqa: E402
from leases.tasks.models import Job, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402

QUEUE = "example-jobs"


@handler("example.thumbnail", queue=QUEUE, max_attempts=3, backoff=0.2)
def thumbnail(payload: dict[str, Any]) -> dict[str, str]:
    # Whatever a handler returns (JSON) is stored as the job's result.
    return {"thumbnail": payload["image"].replace(".jpg", "-small.jpg")}


@handler("example.charge", queue=QUEUE, max_attempts=5)
def charge(payload: dict[str, Any]) -> dict[str, int]:
    if payload["cents"] <= 0:
        # Retrying would fail the same way: Fail ends the job now, whatever attempts are left.
        raise Fail(f"refusing to charge {payload['cents']} cents")
    return {"charged": payload["cents"]}


# Stands in for a flaky remote service: the first call for each URL fails. A counter in
# memory only works because the worker runs in this process; real handlers keep no state.
_calls: Counter[str] = Counter()


@handler("example.fetch", queue=QUEUE, max_attempts=3, backoff=0.2)
def fetch(payload: dict[str, Any]) -> dict[str, int]:
    _calls[payload["url"]] += 1
    if _calls[payload["url"]] == 1:
        raise ConnectionError(f"{payload['url']} timed out")
    # Retried after the backoff: between half and all of backoff * 2**(attempt-1) seconds.
    return {"status": 200}


def push_jobs() -> int:
    """Push the example's jobs; returns the id of the delayed one."""
    cat = push("example.thumbnail", {"image": "cat.jpg"}, key="thumbnail:cat.jpg")
    # The same key while the first job still waits: no second job, the waiting one takes
    # the new run time and priority (the latest push says what is wanted now).
    again = push("example.thumbnail", {"image": "cat.jpg"}, key="thumbnail:cat.jpg", priority=5)
    assert again is not None and cat is not None
    print(f"pushed cat.jpg twice with one key: one job #{again.pk} (same id: {again.pk == cat.pk}),"
          f" merged={again.merged}, pushes={again.pushes}, priority now {again.priority}")

    push("example.thumbnail", {"image": "dog.jpg"})  # key: a hash of name and payload
    push("example.charge", {"cents": 0}, priority=10)  # higher priorities run first
    push("example.fetch", {"url": "https://example.com/feed"}, max_attempts=2)  # per-push override
    later = push("example.thumbnail", {"image": "weekly.jpg"}, delay=3600)
    assert later is not None
    return later.pk


def main() -> None:
    call_command("migrate", verbosity=0)
    worker = JobWorker(queues=[QUEUE], concurrency=1, burst=True, poll=0.01)
    try:
        delayed = push_jobs()
        # One thread, so the jobs run one at a time in claim order: priority, then run time.
        stats = worker.run()
        print(f"burst worker done: {stats.succeeded} succeeded, {stats.failed} failed attempts")

        # Ties (same instant) broken as the claim orders them: priority, then run time.
        ran = Job.objects.filter(queue=QUEUE).exclude(pk=delayed)
        for job in ran.order_by("started_at", "-priority", "run_at", "pk"):
            print(f"  #{job.pk} {job.name}, priority {job.priority}: {job.get_status_display()},"
                  f" attempt {job.attempt} of {job.max_attempts}, result {job.result}")
            for error in job.errors.order_by("attempt"):  # one JobError per failed attempt
                print(f"      attempt {error.attempt} failed: {error.exception}: {error.message}")
        waiting = Job.objects.get(pk=delayed)
        due = (waiting.run_at - waiting.enqueued_at).total_seconds()
        print(f"  #{waiting.pk} {waiting.name}: still {waiting.get_status_display()}, due in {due:.0f}s"
              " (a burst worker leaves it)")
    finally:
        Job.objects.filter(queue=QUEUE).delete()  # their JobError rows go with them
        Queue.objects.filter(name=QUEUE).delete()  # made on the first push, for the admin
        WorkerRow.objects.filter(name=worker.name).delete()  # the worker's process row


if __name__ == "__main__":
    main()
