"""Jobs that hold resources through faults: worker processes behind the fault proxy lose
COMMIT replies of their claims and endings, and one is SIGKILLed mid-run. No job runs
without its lease (no resource serves two runs at once, by the handlers' own log), no
lease stays held without its job once the ttl has passed, and every job ends."""
from __future__ import annotations

import os
import signal
import time

import pytest
from django.db import connection

import tests.jobs_leased  # noqa: F401 - registers leased.fetch here (the pusher)
from leases import Pool
from leases.clock import db_now
from leases.models import Resource
from leases.tasks import push_many
from leases.tasks.models import Job
from tests.conftest import wait_for
from tests.processes.test_leased_processes import no_overlap_and_growing_tokens, runs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

COMMIT = r"^\s*COMMIT\b"


@pytest.fixture(autouse=True)
def a_server():
    if connection.vendor == "sqlite":
        pytest.skip("the fault-injection proxy stands in front of a server")


def test_lost_replies_and_a_killed_worker_leave_no_job_without_its_lease_nor_a_lease_without_its_job(
        proxied_workers, proxy, tmp_path):
    log = tmp_path / "runs.log"
    Pool("crawlpool").add_many([(f"r{n}", None) for n in range(6)])
    push_many([("leased.fetch", {"n": n, "site": f"s{n % 3}", "seconds": 0.02, "log": str(log)}) for n in range(600)])
    # A claim of a job with its lease ends with the job's lease written; an ending with the
    # resource's release (then, on PostgreSQL, the wake-up of listening workers).
    claims = proxy.drop_reply(COMMIT, probability=0.05, seed=5, after=r"resource_id = CASE id")
    endings = proxy.drop_reply(COMMIT, probability=0.05, seed=6, after=r"SET busy_before = .*holder = ''|pg_notify")
    procs = [proxied_workers.start("--concurrency", "4", "--ttl", "2", "--import", "tests.jobs_leased")
             for _ in range(3)]
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() >= 150, 60, "the drain to start")
    os.kill(procs[0].pid, signal.SIGKILL)
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 600, 180, "every job")
    for proc in procs[1:]:
        proc.send_signal(signal.SIGTERM)
    for proc in procs[1:]:
        assert proxied_workers.wait(proc, 60) == 0, proxied_workers.stderr(proc)
    assert claims.dropped >= 1 and endings.dropped >= 1
    found = runs(log)
    assert set(run["n"] for run in found) == set(range(600))
    no_overlap_and_growing_tokens(found)  # no job ran without its lease
    time.sleep(2.5)  # the killed worker's leases lapse with its jobs' ttl
    now = db_now()
    assert [r.name for r in Resource.objects.filter(pool="crawlpool") if r.state_at(now) == Resource.HELD] == []
