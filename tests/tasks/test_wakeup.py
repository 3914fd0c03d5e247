"""Pushes wake listening workers on PostgreSQL (NOTIFY at commit, one per queue however
many jobs), and nowhere else is anything sent or listened for."""
from __future__ import annotations

import pytest
from django.db import connection, connections, transaction

import tests.jobs  # noqa: F401 - registers noop
from leases import db
from leases.tasks import push, push_many
from leases.tasks.jobs.push import CHANNEL

pytestmark = pytest.mark.django_db(transaction=True)

postgres_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's")


@pytest.fixture
def listener():
    """A connection of its own, listening as a worker's would."""
    other = connections.create_connection("default")
    assert db.listen(other, CHANNEL)
    yield other
    other.close()


def heard(listener, timeout: float = 0.5) -> list[str]:
    """Every payload that arrives until `timeout` passes with none."""
    payloads = []
    while batch := db.notifications(listener, timeout):
        payloads += batch
    return payloads


@postgres_only
def test_a_bulk_push_is_one_notification_per_queue(listener):
    jobs = [("noop", {"n": n}, {"queue": "other" if n % 2 else "default"}) for n in range(900)]
    assert push_many(jobs) == 900
    assert sorted(heard(listener)) == ["default", "other"]


@postgres_only
def test_delayed_jobs_wake_nobody_and_due_ones_do(listener):
    push("noop", {"n": 1}, delay=60, queue="other")
    assert heard(listener) == []
    push("noop", {"n": 2})
    assert heard(listener) == ["default"]


@postgres_only
def test_a_push_inside_a_transaction_wakes_workers_only_when_it_commits(listener):
    with transaction.atomic():
        push("noop", {"n": 1})
        assert heard(listener, 0.3) == []  # a worker woken now would not see the job
    assert heard(listener) == ["default"]
    with pytest.raises(RuntimeError), transaction.atomic():
        push("noop", {"n": 2}, queue="other")
        raise RuntimeError("rolled back")
    assert heard(listener) == []


@pytest.mark.skipif(connection.vendor == "postgresql", reason="the databases without notifications")
def test_elsewhere_nothing_listens():
    assert not db.listen(connection, CHANNEL)
    assert db.dialect(connection).notify == ""
