"""Django's Tasks framework on the leases job queue: ``@task``, ``.enqueue()``, a worker, results.

Tasks are stored as jobs of the leases queue by ``leases.tasks.backend.DatabaseBackend``
and run by the same workers as native jobs. A project configures the backend in
settings.py, for instance::

    TASKS = {
        "default": {
            "BACKEND": "leases.tasks.backend.DatabaseBackend",
            "QUEUES": ["default"],  # the queue names tasks may use
            # Tries per task, base of the retry backoff (seconds), time limit of an attempt.
            "OPTIONS": {"max_attempts": 3, "backoff": 10.0, "timeout": None},
        }
    }

The demo project's settings.py already has such a "default" alias for its own queues.
So as not to touch those, this example adds an alias "example" with the queue
"example-tasks" to TASKS before Django starts (changing settings at run time is not
something a project does: there the dict above is all it takes). It then enqueues a few
tasks, runs a worker in this process with ``burst=True`` (returns once nothing is ready;
in production: ``manage.py leases_worker --queue example-tasks --import <tasks module>``)
and reads the results back.

Django 6 has the framework as ``django.tasks``; on Django 5.2 it is the ``django-tasks``
package (``django_tasks``); both work.

Run it from the checkout::

    python -m project.examples.tasks

With DATABASE_URL unset it works on db.sqlite3 in the checkout (set DATABASE_URL to use
another database); it applies the migrations first, uses only the queue "example-tasks",
and deletes its rows at the end, so it can run again and again. On stderr come the
worker's warnings about the failed attempts and the framework's own log of the task that
failed for good, with its traceback: all of that is expected.
"""
from __future__ import annotations

import os
from datetime import timedelta

import django
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("LEASES_LOG_LEVEL", "WARNING")

ALIAS, QUEUE = "example", "example-tasks"
if ALIAS not in settings.TASKS:  # before anything reads TASKS; see the docstring
    settings.TASKS = {
        **settings.TASKS,
        ALIAS: {
            "BACKEND": "leases.tasks.backend.DatabaseBackend",
            "QUEUES": [QUEUE],
            # A short backoff so that the retries below happen within the example's run.
            "OPTIONS": {"max_attempts": 3, "backoff": 0.2},
        },
    }
django.setup()  # before importing anything that touches the app's models

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402

try:  # Django 6
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task
except ImportError:  # Django 5.2 with the django-tasks package
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, task

from leases.tasks import JobWorker  # noqa: E402
from leases.tasks.models import Job, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402


# Arguments and return values must be JSON. A task's "name" in the queue is its import
# path, project.examples.tasks.word_count here: that is what a worker imports to run it.
@task(backend=ALIAS, queue_name=QUEUE)
def word_count(text: str) -> int:
    return len(text.split())


@task(backend=ALIAS, queue_name=QUEUE, priority=10)  # higher priorities run first
def send_welcome(email: str) -> str:
    return f"welcome mail sent to {email}"


@task(backend=ALIAS, queue_name=QUEUE, takes_context=True)
def upload(context: TaskContext, name: str) -> str:
    # context.attempt counts from 1; a task that raises is retried up to max_attempts.
    if context.attempt == 1:
        raise ConnectionError("storage not reachable")
    return f"{name} uploaded on attempt {context.attempt}"


@task(backend=ALIAS, queue_name=QUEUE)
def ratio(a: float, b: float) -> float:
    return a / b  # b=0 fails every attempt, so the task ends FAILED


def describe(result: TaskResult) -> str:
    call = f"{result.task.name}({', '.join(map(repr, result.args))})"
    if not result.is_finished:
        return f"{call}: {result.status}"
    # return_value raises unless the task succeeded; errors hold one entry per failed attempt.
    value = f", returned {result.return_value!r}" if result.status == TaskResultStatus.SUCCESSFUL else ""
    errors = [error.exception_class.__name__ for error in result.errors]
    return f"{call}: {result.status} after {result.attempts} attempt(s){value}" + (
        f", errors {errors}" if errors else ""
    )


def main() -> None:
    call_command("migrate", verbosity=0)
    worker = JobWorker(queues=[QUEUE], concurrency=2, burst=True, poll=0.01)
    try:
        results = [
            word_count.enqueue("the quick brown fox"),
            send_welcome.enqueue("ada@example.com"),
            upload.enqueue("report.pdf"),
            ratio.enqueue(1, 0),
        ]
        # run_after defers a task; a burst worker leaves it waiting.
        later = word_count.using(run_after=timezone.now() + timedelta(hours=1)).enqueue("see you later")
        print(f"enqueued {len(results) + 1} tasks, e.g. {results[0].task.module_path} as result id"
              f" {results[0].id}: {results[0].status}")

        stats = worker.run()
        print(f"burst worker done: {stats.succeeded} succeeded, {stats.failed} failed attempts")

        for result in results:
            result.refresh()  # reads the job row again
            print(f"  {describe(result)}")
        # Any process can look a result up by its id, e.g. one a web page kept.
        print(f"  {describe(word_count.get_result(later.id))} (due in an hour)")
    finally:
        Job.objects.filter(queue=QUEUE).delete()  # their JobError rows go with them
        Queue.objects.filter(name=QUEUE).delete()  # made on the first enqueue, for the admin
        WorkerRow.objects.filter(name=worker.name).delete()  # the worker's process row


if __name__ == "__main__":
    # Run the tasks defined under the module's import path, not as __main__: a job names
    # its task by that path, and this is how it reads in the admin and to other workers.
    from project.examples import tasks

    tasks.main()
