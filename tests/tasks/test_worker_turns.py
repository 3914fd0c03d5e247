"""A worker's turn takes one transaction: the outcomes of the jobs that finished are written
in the transaction of its next claim. Outcomes that take other locks (a key's slot, a
resource, a follow-up) are written apart first; an outcome the database refuses does not
lose the claim nor block the others."""
from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest

import tests.jobs  # noqa: F401 - registers noop, limited
from leases import db
from leases.tasks import push, push_many
from leases.tasks.jobs.outcomes import Outcome
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


@contextmanager
def transactions(monkeypatch):
    """How many of the engine's write transactions begin (outermost ones)."""
    count = [0]
    real = db.write_transaction

    @contextmanager
    def counted(using=None):
        count[0] += 1
        with real(using):
            yield

    monkeypatch.setattr(db, "write_transaction", counted)
    yield count


def test_outcomes_ride_with_the_next_claim(monkeypatch):
    push_many(("noop", {"n": n}) for n in range(60))
    worker = JobWorker(queues=["default"], concurrency=4, burst=True, ttl=10)
    worker.register()
    with transactions(monkeypatch) as count:
        stats = worker.run()
    assert stats.succeeded == 60 and Job.objects.filter(status=Job.SUCCEEDED).count() == 60
    # A claim each turn, and its outcomes in it: not a transaction for each besides (60
    # jobs at 4 a claim were 30 transactions and more that way).
    assert stats.claims >= 15
    assert count[0] <= stats.claims + 3, (count[0], stats.claims)


def test_outcomes_that_free_a_keys_slot_are_written_apart_and_all_end(monkeypatch):
    """Jobs with a limit per key free their key's slot when they end: that row's lock is
    not a claim's to take after its jobs', so they get their own transaction first."""
    push_many(("limited", {"key": f"site{n}", "seconds": 0}) for n in range(12))
    worker = JobWorker(queues=["default"], concurrency=4, burst=True, ttl=10)
    worker.register()
    with transactions(monkeypatch) as count:
        stats = worker.run()
    assert stats.succeeded == 12 and Job.objects.filter(status=Job.SUCCEEDED).count() == 12
    assert count[0] > stats.claims  # written apart


def test_a_refused_outcome_with_a_claim_is_written_apart_and_the_claim_goes_on(caplog):
    jobs = [push("noop", {"n": n}) for n in range(4)]
    worker = JobWorker(queues=["default"], concurrency=4, ttl=5)
    worker.register()
    first, poisoned = worker.claim(2)
    worker._pending = [Outcome(first, ok=True, result='"fine"'),
                       Outcome(poisoned, ok=True, result="{not json")]  # the CHECK refuses it
    with caplog.at_level(logging.WARNING, "leases.tasks.worker"):
        claimed = worker.claim(2)
    assert sorted(job.id for job in claimed) == [job.pk for job in jobs[2:]]
    assert worker._pending == []
    rows = {row.pk: row for row in Job.objects.filter(pk__in=[first.id, poisoned.id])}
    assert (rows[first.id].status, rows[first.id].result) == (Job.SUCCEEDED, "fine")
    assert rows[poisoned.id].status == Job.FAILED
    assert "writing 2 outcomes with a claim failed" in caplog.text
    assert Job.objects.filter(status=Job.RUNNING).count() == 2  # the claim after it


def test_outcomes_wait_while_the_database_is_away_and_the_claim_is_not_lost(monkeypatch):
    """An outage during the claim that carries outcomes keeps them pending (their jobs stay
    the worker's); the next claim, unsure, looks up what it may have claimed unseen and
    carries none (they are written after it)."""
    push_many(("noop", {"n": n}) for n in range(4))
    worker = JobWorker(queues=["default"], concurrency=4, ttl=5)
    worker.register()
    (job,) = worker.claim(1)
    worker._pending = [Outcome(job, ok=True, result='"done"')]
    from django.db import OperationalError

    from leases.tasks.jobs import claim as claims

    def away(*args, **kwargs):
        raise OperationalError(2013, "Lost connection to server during query")

    monkeypatch.setattr(claims, "claim", away)
    monkeypatch.setattr(worker, "_outage", lambda exc: True)
    with pytest.raises(OperationalError):
        worker.claim(3)
    assert [o.job.id for o in worker._pending] == [job.id] and worker._claim_unsure
    monkeypatch.undo()
    claimed = worker.claim(3)
    assert len(claimed) == 3 and len(worker._pending) == 1 and not worker._claim_unsure
    worker._flush([])
    assert Job.objects.get(pk=job.id).status == Job.SUCCEEDED


def test_under_a_backlog_a_claim_waits_briefly_for_half_the_threads(monkeypatch):
    """After a full claim, one finished job of eight does not set off a claim of one: the
    claim waits up to GATHER for half the threads, then claims whatever is free."""
    from leases.tasks.worker import loop

    clock = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    worker = JobWorker(queues=["default"], concurrency=8)
    worker.running = dict.fromkeys(range(7))
    worker._claimed_full = True
    assert worker._gathering()
    assert 0 < worker._wait_time([]) <= loop.GATHER
    clock[0] += loop.GATHER / 2
    assert worker._gathering()
    clock[0] += loop.GATHER
    assert not worker._gathering()  # waited long enough: claim the one
    worker.running = dict.fromkeys(range(4))
    assert not worker._gathering()  # half free: at once
    worker.running, worker._claimed_full = dict.fromkeys(range(7)), False
    assert not worker._gathering()  # no backlog: a free thread is claimed for at once


def test_outcomes_wait_for_the_claim_a_gathering_worker_makes(monkeypatch):
    """While a claim gathers free threads, the outcomes already in wait for it rather than
    take a transaction of their own."""
    push_many(("noop", {"n": n}) for n in range(8))
    worker = JobWorker(queues=["default"], concurrency=8, ttl=10)
    worker.register()
    claimed = worker.claim(8)
    worker.running = {job.id: job for job in claimed[1:]}
    worker._claimed_full = True
    worker._done.put(Outcome(claimed[0], ok=True, result="null"))
    written: list = []
    monkeypatch.setattr(worker, "finish", written.append)
    from leases.tasks.worker.threads import Threads

    worker._turn(Threads(8, worker._done), [])
    assert written == [] and [o.job.id for o in worker._pending] == [claimed[0].id]
    assert worker._free_since is not None
