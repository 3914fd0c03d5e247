"""Pipelines run by real `manage.py leases_worker` processes: a for_each of 500 items
bounded by max_parallel, and 100 runs on three workers that are SIGKILLed as they go.
Handlers append "stage task item pid" lines to a log file, so what ran is counted
outside the database under test."""
from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter

import pytest
from django.db.models import Sum

import tests.pipes as pipes
from leases.pipelines import machine
from leases.pipelines.definition import get
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks.models import Job
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]


def most_at_once(intervals: list[tuple]) -> int:
    """The largest number of [start, end) intervals that hold at one instant."""
    edges = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    most = current = 0
    for _, step in edges:  # at equal times an end (-1) sorts before a start
        current += step
        most = max(most, current)
    return most


def log_lines(path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_a_for_each_of_500_items_never_runs_more_than_max_parallel_and_joins_once(workers, tmp_path):
    log = tmp_path / "runs.log"
    run = pipes.crawl.start(context={"items": 500, "nap": 0.02, "log": str(log)})
    procs = [workers.start("--queue", "default", "--concurrency", "10", "--poll", "0.02") for _ in range(3)]
    wait_for(lambda: Run.objects.get(pk=run.pk).status != Run.RUNNING, 120, "the run to finish")
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc) == 0, workers.stderr(proc)

    run.refresh_from_db()
    assert (run.status, run.progress()) == (Run.SUCCEEDED, (504, 504)), run.error
    fetch = list(TaskRun.objects.filter(run=run, stage__name="fetch").values_list("started_at", "finished_at"))
    assert len(fetch) == 500 and all(start and end for start, end in fetch)
    most = most_at_once(fetch)
    assert 10 <= most <= 20, most  # bounded, and actually parallel
    ran = Counter(line[1] for line in log_lines(log))
    assert ran["fetch"] == 500 and ran["index"] == 1  # the join ran once
    # Run across processes. Not necessarily all three: the worker whose task frees a slot
    # queues the next item in the same transaction and may claim it next, so two workers of
    # 10 threads can keep the 20 slots between them while the third starts.
    assert len({line[3] for line in log_lines(log) if line[1] == "fetch"}) >= 2
    index = TaskRun.objects.get(run=run, task="p.index")
    assert index.result["fetched"] == [n * 10 for n in range(500)]
    assert Job.objects.filter(name="p.fetch").count() == 500


def test_100_runs_on_three_workers_killed_as_they_go_all_succeed_once(workers, tmp_path):
    log = tmp_path / "runs.log"
    runs = [pipes.three.start(context={"log": str(log), "nap": 0.01}) for _ in range(100)]
    options = ("--queue", "default", "--concurrency", "4", "--ttl", "1.5", "--poll", "0.02")
    procs = [workers.start(*options) for _ in range(3)]
    rng = random.Random(7)
    kills = 0
    deadline = time.monotonic() + 150
    while Run.objects.filter(status=Run.RUNNING).exists():
        assert time.monotonic() < deadline, "runs still running after 150 s"
        if kills < 8:
            time.sleep(rng.uniform(0.3, 1.0))
            victim = rng.randrange(len(procs))
            os.kill(procs[victim].pid, signal.SIGKILL)
            workers.wait(procs[victim])
            kills += 1
            procs[victim] = workers.start(*options)
        else:
            time.sleep(0.2)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc) == 0, workers.stderr(proc)

    assert kills == 8
    assert set(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)) == {Run.SUCCEEDED}
    # No stage was started twice (its tasks are made once) and none restarted.
    per_stage = Counter(TaskRun.objects.values_list("stage_id", flat=True))
    assert len(per_stage) == 300 and set(per_stage.values()) == {5}
    assert set(StageRun.objects.values_list("status", "restarts", "total", "pending")) == {(StageRun.SUCCEEDED, 0, 5, 0)}
    assert set(TaskRun.objects.values_list("status", flat=True)) == {TaskRun.SUCCEEDED}
    # None stuck: every job, task or event, ended, and each task's job is the one recorded.
    assert not Job.objects.exclude(status=Job.SUCCEEDED).exists()
    # Each task's end was recorded once, by the statement that ended its job: each stage's
    # last one moved its run on in the same transaction, or, when another worker's step
    # held the run, pushed its event once (a push merges into an event that still waits).
    assert (Job.objects.filter(name=machine.EVENT).aggregate(n=Sum("pushes"))["n"] or 0) < 300
    # Order, from recorded times: no task started before the stage it needs had finished.
    needs = get("three-by-five").requires()
    finished = {(s.run_id, s.name): s.finished_at for s in StageRun.objects.all()}
    for task in TaskRun.objects.select_related("stage"):
        for need in needs[task.stage.name]:
            assert task.started_at >= finished[(task.run_id, need)], task
    # Every task ran; one ran again only when a kill caught it (at most 4 running per worker).
    ran = len(log_lines(log))
    assert 1500 <= ran <= 1500 + kills * 4, ran
