"""Every code path of a real worker on the database under test, not only the tests' happy
paths: two workers lead the scheduler, fire schedules that push jobs and start pipelines,
advance pipelines with fan-out and fan-in, retry and fail jobs, and recover; their logs
must hold no ERROR line and no traceback (driver differences, such as a missing
`lastrowid` or another row count, surface there first)."""
from __future__ import annotations

import signal
import time

import pytest

from leases.pipelines.models import Run
from leases.tasks import push_many, schedule
from leases.tasks.models import Job, ScheduleRun
from leases.tasks.schedules import set_enabled
from tests.conftest import wait_for
from tests.pipes import crawl

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

def test_workers_with_schedules_and_pipelines_log_no_error(workers, tmp_path):
    procs = [workers.start("--queue", "default", "--ttl", "3", "--concurrency", "4") for _ in range(2)]
    schedule("clean-logs.tick", "noop", every=1, payload={"n": "tick"})
    schedule("clean-logs.pipeline", pipeline=crawl.name, every=2, context={"items": 3})
    push_many([("noop", {"n": n}) for n in range(50)] + [("boom", {"n": n}) for n in range(3)])
    crawl.start({"items": 3})  # fan-out over what discover finds, fan-in, parallel media
    wait_for(lambda: Run.objects.filter(pipeline=crawl.name, status=Run.SUCCEEDED).count() >= 3, 60,
             "three pipeline runs to succeed")
    set_enabled("clean-logs.tick", False)
    set_enabled("clean-logs.pipeline", False)
    wait_for(lambda: not Job.objects.filter(status__in=[Job.READY, Job.RUNNING]).exists(), 60, "the queue to drain")
    time.sleep(1)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc) == 0
    assert ScheduleRun.objects.filter(schedule__name="clean-logs.tick").count() >= 3
    for proc in procs:
        log = workers.stderr(proc)
        bad = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
        # A job that fails for good is an ERROR line by design (boom fails all its attempts):
        bad = [line for line in bad if "job boom #" not in line]
        assert not bad, log
