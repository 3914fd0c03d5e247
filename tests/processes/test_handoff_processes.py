"""A job whose handler some workers lack reaches a worker that has it, promptly, as real
`leases_worker` processes: workers started without the `--import` that defines it hand its
jobs to one started with it, at once, instead of bouncing them among themselves every
10 s; a worker that starts later with it takes what they handed back at once, a `--burst`
one included; and their log line names the fix."""
from __future__ import annotations

import signal

import pytest

import tests.jobs_elsewhere  # noqa: F401 - registers crawl.sitemap here (the pusher), not in the workers
from leases.tasks import push_many
from leases.tasks.models import Job
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

WITH_IT = ("--import", "tests.jobs_elsewhere")


def started(workers, procs) -> None:
    wait_for(lambda: all("started" in workers.stderr(proc) for proc in procs), 30, "the workers to start")


def stop(workers, procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc) == 0, workers.stderr(proc)


def test_workers_without_the_handler_hand_its_jobs_to_the_one_that_has_it_at_once(workers):
    lacking = [workers.start("--queue", "default", "--concurrency", "4") for _ in range(2)]
    # Polling every 2 s, never woken by a push: the workers without the handler claim the
    # jobs first, so what they do with them is what this tests.
    capable = workers.start("--queue", "default", "--concurrency", "2", "--poll", "2", "--no-listen", *WITH_IT)
    started(workers, [*lacking, capable])
    push_many([("crawl.sitemap", {"n": n}) for n in range(8)])
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 8, 8, "the jobs, within 8 s")
    assert set(Job.objects.values_list("result", flat=True)) == {capable.pid}
    assert set(Job.objects.values_list("attempt", flat=True)) == {1}  # a hand-off uses no try
    stop(workers, [*lacking, capable])
    said = "".join(workers.stderr(proc) for proc in lacking)
    assert "a worker that has it takes it" in said and "--import the module that defines it" in said, said


def test_a_worker_that_starts_with_the_handler_takes_what_others_handed_back(workers):
    # One worker without it, which claims all three at once and then leaves them alone: a
    # second one could claim them in the instant the --burst worker looks, and that worker
    # would leave with nothing to do (a race of the test, not of the hand-over).
    lacking = [workers.start("--queue", "default", "--concurrency", "4")]
    started(workers, lacking)
    push_many([("crawl.sitemap", {"n": n}) for n in range(3)])
    wait_for(lambda: any("no live worker serving default has it" in workers.stderr(proc) for proc in lacking), 10,
             "a worker to hand a job back for later")
    line = next(line for proc in lacking for line in workers.stderr(proc).splitlines() if "no live worker" in line)
    assert "start one with --import the module that defines it" in line, line
    burst = workers.start("--queue", "default", "--burst", *WITH_IT)
    assert workers.wait(burst, 30) == 0, workers.stderr(burst)
    assert "took over" in workers.stderr(burst), workers.stderr(burst)
    assert set(Job.objects.values_list("status", "result")) == {(Job.SUCCEEDED, burst.pid)}
    stop(workers, lacking)
