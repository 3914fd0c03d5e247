"""A job's options given to `@task(...)` itself (Django 6.1 on): they reach the job row and
the worker, bad ones fail where the task is defined, and limits are given in one place."""
from __future__ import annotations

import time

import django
import pytest

from leases import Pool
from leases.tasks import Needs, handler
from leases.tasks.backend import (
    TASK_OPTIONS,
    BaseTaskBackend,
    DatabaseBackend,
    DatabaseTask,
    InvalidTaskError,
    TaskResultStatus,
    task_handler,
)
from leases.tasks.context import current
from leases.tasks.models import Job, JobError
from leases.tasks.registry import TaskLimits, task_limits
from leases.tasks.worker import JobWorker

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

pytestmark = pytest.mark.django_db(transaction=True)
needs_options = pytest.mark.skipif(not TASK_OPTIONS, reason="@task(...) passes options to the backend's"
                                                            " task_class from Django 6.1 on")

if TASK_OPTIONS:  # the worker imports them by path: module-level tasks

    @task(queue_name="tasks", max_attempts=5, limit_key=lambda site, n: site, concurrency=1, rate="2/s")
    def per_site(site: str, n: int) -> int:
        return n

    @task(timeout=0.3, max_attempts=2, backoff=0)
    def slow(seconds: float) -> None:
        time.sleep(seconds)

    @task(lease=Needs("taskpool", target=lambda site: site))
    def leased(site: str) -> str:
        return current().lease.name


def stacked() -> None:
    """Given limits both by @handler above and by @task in a test."""


def attempts_only() -> None:
    """Given its attempts by @task and its limits by @handler above, in a test."""


def plain() -> None:
    """Made a task with bad options, in a test."""


def run_worker() -> None:
    JobWorker(queues=["default", "tasks"], concurrency=2, burst=True, ttl=5, poll=0.01).run()


def test_the_task_class_is_ours_only_where_task_passes_it_options():
    assert TASK_OPTIONS == (django.VERSION >= (6, 1))  # not on 5.2, whose backport could
    if TASK_OPTIONS:
        assert DatabaseBackend.task_class is DatabaseTask
    else:  # Django 5.2 and 6.0 keep the framework's Task
        assert getattr(DatabaseBackend, "task_class", None) is getattr(BaseTaskBackend, "task_class", None)


@needs_options
def test_the_tasks_options_reach_its_job_row():
    job = Job.objects.get(pk=int(per_site.enqueue("shop.example", 1).id))
    assert (job.queue, job.max_attempts) == ("tasks", 5)
    assert (job.limit_key, job.concurrency, job.rate) == ("shop.example", 1, "2/s")
    other = Job.objects.get(pk=int(per_site.using(queue_name="default").enqueue("b.example", 2).id))
    assert (other.queue, other.limit_key, other.max_attempts) == ("default", "b.example", 5)  # using() keeps them


@needs_options
def test_a_worker_honours_the_tasks_timeout_attempts_and_backoff():
    result = slow.enqueue(1.5)
    job = Job.objects.get(pk=int(result.id))
    runner = task_handler(job)
    assert (runner.timeout, runner.delay(1)) == (0.3, 0.0)  # the backend's: none, and 1.0 s
    run_worker()
    job.refresh_from_db()
    assert (job.status, job.attempt) == (Job.DEAD, 2)
    assert set(JobError.objects.filter(job=job).values_list("exception", flat=True)) == {"builtins.TimeoutError"}
    assert slow.get_result(result.id).status == TaskResultStatus.FAILED


@needs_options
def test_a_leased_task_is_claimed_with_a_resource_of_its_pool():
    Pool("taskpool").add("r1")
    result = leased.enqueue("shop.example")
    job = Job.objects.get(pk=int(result.id))
    assert (job.pool, job.target) == ("taskpool", "shop.example")
    run_worker()
    assert leased.get_result(result.id).return_value == "r1"


@needs_options
@pytest.mark.parametrize("options, error", [
    ({"concurrency": 0}, "concurrency must be"),
    ({"rate": "lots"}, "rate must be"),
    ({"limit_key": 7}, "limit_key must be"),
    ({"lease": 7}, "lease= takes"),
    ({"max_attempts": 0}, "max_attempts must be"),
    ({"backoff": -1}, "backoff must be"),
    ({"timeout": 0}, "timeout must be"),
])
def test_a_bad_option_is_one_line_where_the_task_is_defined(options, error):
    with pytest.raises(InvalidTaskError, match=error) as raised:
        task(**options)(plain)
    assert "\n" not in str(raised.value) and "tests.tasks.test_backend_options.plain" in str(raised.value)
    assert task_limits("tests.tasks.test_backend_options.plain") == TaskLimits()  # nothing registered


@needs_options
def test_limits_from_handler_above_and_from_task_are_refused():
    both = handler(concurrency=2)(task(concurrency=1)(stacked))
    with pytest.raises(InvalidTaskError, match=r"both @handler\(...\) above it and @task\(...\)") as raised:
        both.enqueue()
    assert "\n" not in str(raised.value) and not Job.objects.exists()
    split = handler(rate="1/s")(task(max_attempts=4)(attempts_only))  # limits in one place: fine
    job = Job.objects.get(pk=int(split.enqueue().id))
    assert (job.max_attempts, job.rate) == (4, "1/s")
