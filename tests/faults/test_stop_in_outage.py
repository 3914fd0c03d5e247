"""A `leases_worker` told to stop while its database does not answer: it leaves without
waiting out its grace for nothing, and says in one line, without a traceback, that it
could not release its row and that the row frees itself within its ttl (with its lead
of the scheduler and the jobs still its own)."""
from __future__ import annotations

import re
import signal

import pytest

import tests.jobs  # noqa: F401 - registers sleepy
from leases.tasks import push
from leases.tasks.models import Job, Worker
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TTL = 6


def stopped_in_outage(workers, proxy, proc) -> str:
    """Refuse the database, SIGTERM the worker, and its log once it exited 0."""
    proxy.refuse()
    proc.send_signal(signal.SIGTERM)
    assert workers.wait(proc, 90) == 0, workers.stderr(proc)
    proxy.allow()
    return workers.stderr(proc)


def the_line(log: str) -> str:
    assert "Traceback" not in log, log
    [line] = [line for line in log.splitlines() if "could not release its row" in line]
    assert re.search(r"could not release its row: the database does not answer \(OperationalError: .+\); the row"
                     rf" frees itself within its ttl of {TTL}s", line), line
    return line


def test_an_idle_worker_stopped_in_an_outage_says_its_row_lapses_in_one_line(proxied_workers, proxy):
    proc = proxied_workers.start("--queue", "default", "--ttl", str(TTL))
    wait_for(lambda: "leads" in proxied_workers.stderr(proc), 30, "the worker to lead the scheduler")
    log = stopped_in_outage(proxied_workers, proxy, proc)
    assert the_line(log).endswith(f"within its ttl of {TTL}s, as do the scheduler's lead")
    assert "stopped: 0 claimed: 0 succeeded;" in log
    # Not released (a release clears the holder): the row and the lead free themselves by their ttl.
    assert Worker.objects.exclude(holder="").count() == 1


def test_a_worker_whose_job_runs_says_the_job_lapses_too_and_counts_it(proxied_workers, proxy):
    job = push("sleepy", {"seconds": 30})
    proc = proxied_workers.start("--queue", "default", "--ttl", str(TTL), "--grace", "1", "--no-schedule")
    wait_for(lambda: Job.objects.get(pk=job.pk).status == Job.RUNNING, 30, "the job to run")
    log = stopped_in_outage(proxied_workers, proxy, proc)
    assert the_line(log).endswith(", as do its 1 unfinished job(s) (other workers then recover them)")
    assert "stopped: 1 claimed: 0 succeeded, 1 left to lapse;" in log
    assert Job.objects.get(pk=job.pk).status == Job.RUNNING  # until its lease lapses and a worker recovers it
