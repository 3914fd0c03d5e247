"""What Galera does not certify: row locks. A `SELECT ... FOR UPDATE` (with or without
SKIP LOCKED) locks rows on its own node only; another node's transaction neither waits
for it nor is refused because of it. Certification compares only the rows transactions
*write*. So every decision in the engine writes the row it depends on: a conditional
UPDATE of a job, a lease or a task, and for decisions taken under a lock, the lock's own
row (a limited key's `decisions`, a pipeline run's `revision`).

Each test stops one node's transaction at the point the engine relies on, lets a
transaction on another node run to its end, and resumes the first. On one server the
second would wait for the first's row lock; on Galera one of the two is refused at COMMIT
(error 1213) and db.run does its work again, on what the other committed.
"""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

import tests.jobs  # noqa: F401 - registers noop, limited, echo (queue "other")
from leases.tasks import push
from leases.tasks.jobs import limits
from leases.tasks.jobs.outcomes import Outcome
from leases.tasks.models import Job, LimitKey
from leases.tasks.worker import JobWorker
from tests.galera.conftest import NODES, count_retries

pytestmark = [pytest.mark.django_db(transaction=True, databases=NODES),
              pytest.mark.usefixtures("fresh_queue_settings", "galera_session")]


class Paused:
    """Runs `JobWorker(queues, using="node1").claim(n)` in a thread whose first claim stops
    right after its limit decision (`limits.within_limits`: its picked job rows and limit
    keys locked, its blocks written, nothing committed) until `resume()`."""

    def __init__(self, monkeypatch) -> None:
        self.inside, self.go = threading.Event(), threading.Event()
        self.claimed: list = []
        self.errors: list = []
        real = limits.within_limits

        def within_limits(*args, **kwargs):
            decided = real(*args, **kwargs)
            if threading.current_thread().name == "paused-claim" and not self.inside.is_set():
                self.inside.set()
                self.go.wait(30)
            return decided

        monkeypatch.setattr(limits, "within_limits", within_limits)

    def claim(self, queues: list[str], n: int = 1) -> None:
        def run() -> None:
            try:
                worker = JobWorker(queues=queues, using="node1")
                worker.register()
                self.claimed += worker.claim(n)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                self.errors.append(exc)
            finally:
                connections.close_all()

        self.thread = threading.Thread(target=run, name="paused-claim")
        self.thread.start()
        assert self.inside.wait(30), f"the claim on node1 never got to its decision: {self.errors}"

    def resume(self) -> None:
        self.go.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and not self.errors, self.errors


def worker_on(alias: str, queues: list[str]) -> JobWorker:
    worker = JobWorker(queues=queues, using=alias)
    worker.register()
    return worker


def test_claims_on_two_nodes_that_pick_the_same_job_conflict_and_one_retries(monkeypatch):
    """The claim's SKIP LOCKED skips nothing across nodes, but both claims write the job's
    row: certification aborts the later one, and db.run claims again, elsewhere."""
    first, second = push("noop", {"n": 1}).pk, push("noop", {"n": 2}).pk
    retries = count_retries()
    paused = Paused(monkeypatch)
    paused.claim(["default"])  # picked `first` and locked its row, on node1
    started = time.monotonic()
    taken = worker_on("node2", ["default"]).claim(1)
    assert time.monotonic() - started < 5  # node1's row lock held nothing up on node2
    assert [job.id for job in taken] == [first]  # SKIP LOCKED did not skip it either
    paused.resume()
    assert [job.id for job in paused.claimed] == [second]  # retried after the conflict
    assert retries.kinds["1213"] >= 1
    assert set(Job.objects.values_list("pk", "status", "claims")) == {(first, Job.RUNNING, 1),
                                                                      (second, Job.RUNNING, 1)}


def test_a_keys_concurrency_holds_for_claims_on_two_nodes(monkeypatch):
    """Two queues share the key "k" (concurrency 1); a worker on node1 serves one, a worker
    on node2 the other. On one server the second claim waits for the key's lock and then
    sees the first job running. On Galera both decide "room for one", but both wrote the
    key's row: the later commit is refused and its claim, done again, sees the key full."""
    retries = count_retries()
    LimitKey.objects.create(name="k")  # a key used before: its row exists (making it is a write)
    push("limited", {"key": "k", "n": 1}, concurrency=1)
    push("limited", {"key": "k", "n": 2}, queue="other", concurrency=1)
    paused = Paused(monkeypatch)
    paused.claim(["default"])  # decided: the key has room, its job starts
    threading.Timer(10, paused.go.set).start()  # never a deadlock, whatever the engine does
    on_node2 = worker_on("node2", ["other"]).claim(1)
    paused.resume()
    running = Job.objects.filter(limit_key="k", status=Job.RUNNING).count()
    assert len(paused.claimed) + len(on_node2) == running
    assert running == 1, f"{running} jobs of a key with concurrency 1 started at once"
    assert retries.kinds["1213"] >= 1, "no conflict: the two decisions did not meet"


def test_a_slot_freed_on_one_node_while_another_blocks_the_key_unblocks_a_job(monkeypatch):
    """A claim on node1 finds the key full and blocks its other job, while the running job
    ends on node2. On one server the end waits for the claim's lock, then sees the blocked
    job and readies it. On Galera the two wrote the key's row: whichever commits second is
    refused and done again, so the job is readied or claimed, never left blocked with the
    key's slot free (without waiting for the periodic unblock pass)."""
    retries = count_retries()
    LimitKey.objects.create(name="k")
    push("limited", {"key": "k", "n": 1}, concurrency=1)
    runner = worker_on("node2", ["default"])
    (running,) = runner.claim(1)
    waiting = push("limited", {"key": "k", "n": 2}, concurrency=1).pk
    paused = Paused(monkeypatch)
    paused.claim(["default"])  # the key is full: `waiting` becomes blocked (not committed)
    runner.finish([Outcome(running, ok=True)])  # the slot comes free, on node2
    paused.resume()
    status = Job.objects.get(pk=waiting).status
    assert status in (Job.READY, Job.RUNNING), f"job {waiting} stayed {dict(Job.STATUSES)[status]}"
    assert [job.id for job in paused.claimed] == ([waiting] if status == Job.RUNNING else [])
    assert retries.kinds["1213"] >= 1, "no conflict: the two decisions did not meet"
