"""Pipelines through real faults: three `leases_worker` processes reach the database
through tests/faultproxy.py while replies after COMMIT are lost (those of transactions
that ended a stage's last task and moved its run on among them) and the server refuses
connections for a while. Every run succeeds, each stage's tasks are made once, nothing is
left ready or running, and no worker dies. Handlers log what ran outside the database.
"""
from __future__ import annotations

import signal
import time
from collections import Counter

import pytest
from django.db import connection

from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks.models import Job
from tests import pipes
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

COMMIT = r"^\s*COMMIT\b"
RUNS, STAGES, WIDTH = 40, 3, 5
#: The statement before the COMMIT of a batch of outcomes that moved a run on: the
#: hand-over's savepoint released (MySQL); on PostgreSQL every batch of outcomes ends by
#: waking the waiters of its jobs, a hand-over's among them.
LAST_BEFORE_COMMIT = {"mysql": r"^RELEASE SAVEPOINT", "postgresql": r"pg_notify\('leases_done'"}


@pytest.fixture(autouse=True)
def a_server_behind_the_proxy():
    if connection.vendor == "sqlite":
        pytest.skip("the fault-injection proxy stands in front of a server")


def test_runs_move_on_through_lost_commit_replies_and_an_outage(proxied_workers, proxy, tmp_path):
    log = tmp_path / "runs.log"
    runs = [pipes.three.start(context={"log": str(log)}) for _ in range(RUNS)]
    handovers = proxy.drop_reply(COMMIT, count=4, after=LAST_BEFORE_COMMIT[connection.vendor])
    commits = proxy.drop_reply(COMMIT, probability=0.03, seed=21)
    procs = [proxied_workers.start("--queue", "default", "--concurrency", "4", "--ttl", "2") for _ in range(3)]
    wait_for(lambda: StageRun.objects.filter(status=StageRun.SUCCEEDED).count() >= RUNS // 2, 60,
             "stages to hand over")
    proxy.refuse(4)
    time.sleep(4.5)
    wait_for(lambda: not Run.objects.filter(status=Run.RUNNING).exists(), 150, "every run to end")
    for proc in procs:
        assert proc.poll() is None, f"worker {proc.pid} died:\n{proxied_workers.stderr(proc)}"
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proxied_workers.wait(proc, 60) == 0, proxied_workers.stderr(proc)
        assert "Traceback" not in proxied_workers.stderr(proc), proxied_workers.stderr(proc)

    assert handovers.dropped == 4 and commits.dropped >= 1
    assert set(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)) == {Run.SUCCEEDED}
    # Each stage's tasks were made once, and each stage ended once with all of them counted.
    per_stage = Counter(TaskRun.objects.values_list("stage_id", flat=True))
    assert len(per_stage) == RUNS * STAGES and set(per_stage.values()) == {WIDTH}
    assert set(StageRun.objects.values_list("status", "total", "pending", "done")) == {
        (StageRun.SUCCEEDED, WIDTH, 0, WIDTH)}
    assert set(TaskRun.objects.values_list("status", flat=True)) == {TaskRun.SUCCEEDED}
    assert not Job.objects.exclude(status=Job.SUCCEEDED).exists()
    # Every task ran; one ran again only when a lost reply or the outage caught it running.
    ran = len(log.read_text().splitlines())
    assert RUNS * STAGES * WIDTH <= ran <= RUNS * STAGES * WIDTH + (handovers.dropped + commits.dropped + 3) * 4, ran
