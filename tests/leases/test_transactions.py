"""The engine's write transactions (`leases.db.write_transaction`): what `atomic()` promises
holds on every database (commit, rollback, savepoints inside, on_commit after the COMMIT, a
connection lost inside replaced), and on MySQL they start with one statement, leaving the
session's autocommit alone."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from leases import db
from leases.tasks.models import Queue

pytestmark = pytest.mark.django_db(transaction=True)


def names() -> list[str]:
    return sorted(Queue.objects.values_list("name", flat=True))


def test_it_commits_and_the_session_autocommits_after():
    with db.write_transaction():
        Queue.objects.create(name="a")
        assert connection.in_atomic_block and not connection.get_autocommit()
    assert not connection.in_atomic_block and connection.get_autocommit()
    Queue.objects.create(name="b")  # autocommitted: no transaction left open
    connection.close()
    assert names() == ["a", "b"]


def test_an_error_rolls_everything_back():
    with pytest.raises(ZeroDivisionError):
        with db.write_transaction():
            Queue.objects.create(name="a")
            1 / 0
    assert names() == [] and not connection.in_atomic_block


def test_a_nested_atomic_is_a_savepoint():
    with db.write_transaction():
        Queue.objects.create(name="a")
        with pytest.raises(IntegrityError):
            with transaction.atomic():
                Queue.objects.create(name="b")
                Queue.objects.create(name="a")
        Queue.objects.create(name="c")
    assert names() == ["a", "c"]


def test_on_commit_waits_for_the_commit_and_is_dropped_on_rollback():
    ran: list[str] = []
    with db.write_transaction():
        transaction.on_commit(lambda: ran.append("kept"))
        assert ran == []
    assert ran == ["kept"]
    with pytest.raises(ZeroDivisionError):
        with db.write_transaction():
            transaction.on_commit(lambda: ran.append("dropped"))
            1 / 0
    assert ran == ["kept"]


def test_a_failure_marked_inside_rolls_back_at_the_end():
    """An inner atomic() without a savepoint that failed leaves the transaction to roll back."""
    with db.write_transaction():
        Queue.objects.create(name="a")
        with pytest.raises(ZeroDivisionError):
            with transaction.atomic(savepoint=False):
                1 / 0
    assert names() == []


def test_a_connection_closed_inside_is_replaced_afterwards():
    with pytest.raises(ZeroDivisionError):
        with db.write_transaction():
            Queue.objects.create(name="a")
            connection.close()
            1 / 0
    assert connection.connection is None and not connection.in_atomic_block
    assert names() == []


def test_inside_a_callers_transaction_it_is_part_of_it():
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            with db.write_transaction():
                Queue.objects.create(name="a")
            1 / 0
    assert names() == []


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL switches autocommit with a statement")
def test_on_mysql_no_autocommit_switch_reaches_the_server():
    """atomic() sends SET autocommit=0 and =1 around its transaction (Com_set_option counts
    them); the engine's transaction sends START TRANSACTION and COMMIT only."""
    def switches() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Com_set_option'")
            return int(cursor.fetchone()[1])

    before = switches()
    with db.write_transaction():
        Queue.objects.create(name="a")
    assert switches() - before == 0
    before = switches()
    with transaction.atomic():
        Queue.objects.create(name="b")
    assert switches() - before == 2
