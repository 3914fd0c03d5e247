"""The examples in project/examples run as a newcomer runs them (``python -m ...``), here
against the test database: each exits 0, prints what it shows, and leaves no rows behind,
so it can run again."""
from __future__ import annotations

import subprocess
import sys

import pytest
from django.db.models import Q

from leases.models import Lock
from leases.tasks.models import DispatchWorker, Job, PoolTask, Queue, TaskPool, Worker
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

#: Lines (or parts of lines) each example must print.
EXPECTED = {
    "locks": [
        "adhoc-report: PROCESSING LOCKED: example-lock:report (held by nightly-report:",
        "keep_alive=True: after 1.0s with ttl=0.6s the lock is still held, a rival is refused",
        "and leaving the block raised LeaseLost: lock example-lock:long-job (token 2)",
        "invoice 7 is busy: PROCESSING LOCKED: example-lock:invoice:7 (held by month-end-batch:",
        "@synchronized: invoice 8 sent meanwhile",
    ],
    "dispatcher": [
        "pool loaded: 8 tasks",
        "example-worker-a got ['example.com/news', 'example.com/', 'example.com/blog']",
        "reclaim: 3 tasks of silent workers back in the pool",
        "example-worker-b is back: check_tasks says its old bucket is still its own: False",
        "stats: pool 0, assigned 0, done 8",
    ],
    "jobs": [
        "merged=True, pushes=2, priority now 5",
        "burst worker done: 3 succeeded, 2 failed attempts",
        "example.charge, priority 10: failed, attempt 1 of 5",
        "attempt 1 failed: leases.exceptions.Fail: refusing to charge 0 cents",
        "example.fetch, priority 0: succeeded, attempt 2 of 2, result {'status': 200}",
        "example.thumbnail: still ready, due in 3600s",
    ],
    "tasks": [
        "project.examples.tasks.word_count as result id",
        "word_count('the quick brown fox'): SUCCESSFUL after 1 attempt(s), returned 4",
        "upload('report.pdf'): SUCCESSFUL after 2 attempt(s), returned 'report.pdf uploaded on attempt 2'",
        "ratio(1, 0): FAILED after 3 attempt(s)",
        "word_count('see you later'): READY (due in an hour)",
    ],
}

#: Parts of lines that must come in this order: the jobs ran by priority.
IN_ORDER = {
    "jobs": ["example.charge, priority 10", "example.thumbnail, priority 5", "example.thumbnail, priority 0"],
}


def leftovers() -> dict[str, int]:
    """Rows under the examples' names, by kind: all zero once an example has ended."""
    return {
        "locks": Lock.objects.filter(
            Q(name__startswith="example-") | Q(name__startswith="dispatch-rebuild:example-")
        ).count(),
        "pool tasks": PoolTask.objects.filter(dispatcher__startswith="example-").count(),
        "dispatch workers": DispatchWorker.objects.filter(dispatcher__startswith="example-").count(),
        "task pools": TaskPool.objects.filter(name__startswith="example-").count(),
        "jobs": Job.objects.filter(queue__startswith="example-").count(),
        "queues": Queue.objects.filter(name__startswith="example-").count(),
        "queue workers": Worker.objects.filter(queues__startswith="example-").count(),
    }


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_example_runs_twice_and_leaves_nothing_behind(name, child_env):
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, "-m", f"project.examples.{name}"],
            cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, f"run {run}:\n{done.stdout}\n{done.stderr}"
        for line in EXPECTED[name]:
            assert line in done.stdout, f"run {run}: {line!r} missing from:\n{done.stdout}"
        where = [done.stdout.index(part) for part in IN_ORDER.get(name, [])]
        assert where == sorted(where), f"run {run}: out of order:\n{done.stdout}"
        assert not any(leftovers().values()), f"run {run} left {leftovers()}"

