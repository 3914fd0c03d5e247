"""The stop line of a `leases_worker` process counts every attempt it claimed in exactly
one bucket, so the buckets add up to "claimed": a success, a retry, failures for good,
an operator's cancel, a ban through `ctx.ban`, a job whose handler it lacks, a durable
sleep, and a job still running when the stop's grace ran out. A cancelled job used to
count as failed, and banned and handed-back ones were missing."""
from __future__ import annotations

import re
import signal

import pytest

import tests.jobs  # noqa: F401 - registers noop, boom, refuse, sleepy
import tests.jobs_durable  # noqa: F401 - durable-cooperative, durable-sleeper
import tests.jobs_leased  # noqa: F401 - leased.fetch
from leases import Pool
from leases.tasks import handler, push
from leases.tasks.jobs.actions import cancel
from leases.tasks.models import Job
from leases.tasks.worker.report import BUCKETS
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

IMPORTS = ("--import", "tests.jobs_leased", "--import", "tests.jobs_durable")
LINE = re.compile(r"stopped: (\d+) claimed: (.+); (\d+) jobs of stopped workers recovered")


@handler("summary.elsewhere", queue="default", max_attempts=1)
def elsewhere(payload):
    """Registered in this process only: the worker lacks it and gives its job back."""


def status(job) -> int:
    return Job.objects.get(pk=job.pk).status


def counts(log: str) -> tuple[int, dict[str, int]]:
    """(claimed, {bucket: count}) of a worker's stop line."""
    [found] = [LINE.search(line) for line in log.splitlines() if LINE.search(line)]
    claimed, buckets = int(found[1]), {}
    for part in found[2].split(", "):
        number, words = part.split(" ", 1)
        buckets[words] = int(number)
    return claimed, buckets


def test_the_stop_line_puts_each_claimed_attempt_in_one_bucket(workers, tmp_path):
    Pool("crawlpool").add("r1")
    jobs = {
        "noop": push("noop", {"n": 1}),
        "boom": push("boom", {"n": 2}),  # three attempts: two retried, then dead
        "refuse": push("refuse", {}),  # Fail: failed for good at once
        "banned": push("leased.fetch", {"site": "a.example", "ban_on": "r1", "n": 3}),
        "elsewhere": push("summary.elsewhere", {}),
        "sleeper": push("durable-sleeper", {"n": 4, "entries": str(tmp_path / "entries")}),
        "cancelled": push("durable-cooperative", {"n": 5, "entries": str(tmp_path / "entries"), "mode": "check"}),
        "handed back": push("sleepy", {"seconds": 120}),
    }
    proc = workers.start(*IMPORTS, "--queue", "default", "--concurrency", "8", "--ttl", "3", "--grace", "2")
    wait_for(lambda: status(jobs["cancelled"]) == Job.RUNNING, 30, "the cooperative job to run")
    assert cancel([jobs["cancelled"].pk]) == 1  # its worker learns it at its next heartbeat
    wait_for(lambda: status(jobs["cancelled"]) == Job.CANCELLED, 30, "the cancel to stop it")
    wait_for(lambda: status(jobs["boom"]) == Job.DEAD, 30, "boom to run out of attempts")
    wait_for(lambda: Job.objects.get(pk=jobs["sleeper"].pk).waiting_for == "sleep", 30, "the durable sleep")
    wait_for(lambda: Job.objects.get(pk=jobs["elsewhere"].pk).attempt == 0
             and "no handler here for summary.elsewhere" in workers.stderr(proc), 30, "the job it lacks to go back")
    wait_for(lambda: "banned for target 'a.example'" in workers.stderr(proc), 30, "the ban")
    assert (status(jobs["noop"]), status(jobs["refuse"]), status(jobs["handed back"])) == (
        Job.SUCCEEDED, Job.FAILED, Job.RUNNING)
    proc.send_signal(signal.SIGTERM)
    assert workers.wait(proc) == 0
    log = workers.stderr(proc)
    claimed, buckets = counts(log)
    assert set(buckets) <= {"succeeded"} | {words for _, words in BUCKETS}, log
    assert claimed == sum(buckets.values()), log  # every attempt in one bucket
    bounced = buckets.pop("bounced")  # again each time it comes back while nobody has its handler
    assert bounced >= 1 and claimed == 9 + bounced, log
    assert buckets == {"succeeded": 1, "retried": 2, "failed for good": 2, "cancelled": 1, "banned": 1,
                       "suspended": 1, "handed back": 1}, log
    assert status(jobs["handed back"]) == Job.READY  # back to the queue, no try used
