"""A single push is one statement where an INSERT returns columns: the upsert returns the
row it leaves and, outside a caller's transaction, commits by itself; the Job it returns
is the row as stored, merges and all; where the database cannot return columns, and for
a job that takes its pool's turn, the transaction and its read-back are kept."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

import tests.jobs  # noqa: F401 - registers the handlers
from leases import db
from leases.clock import db_now
from leases.tasks import push
from leases.tasks.jobs import push as push_module
from leases.tasks.jobs.push import CHANNEL
from leases.tasks.models import Job

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


@pytest.fixture
def returns_columns():
    """Skip where an INSERT returns no columns (MySQL; asked once connected, not at import)."""
    if not connection.features.can_return_columns_from_insert:
        pytest.skip("this database's INSERT returns no columns")


@pytest.fixture
def sent(monkeypatch):
    """The statements the engine sends, each with whether a transaction was open."""
    statements: list[tuple[str, bool]] = []
    execute = db.Cursor.execute

    def counting(self, sql, params=()):
        statements.append((sql, self.db.in_atomic_block))
        return execute(self, sql, params)

    monkeypatch.setattr(db.Cursor, "execute", counting)
    return statements


@pytest.fixture
def without_returning(monkeypatch):
    """The database as one whose INSERT returns no columns (MySQL)."""
    monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)


def stored(job: Job) -> tuple:
    return (job.pk, job.queue, job.name, job.backend, job.payload, job.key, job.pending_key, job.priority,
            job.run_at, job.status, job.attempt, job.max_attempts, job.enqueued_at, job.pushes)


@pytest.mark.usefixtures("returns_columns")
@pytest.mark.parametrize("options", [{}, {"delay": 30}, {"run_at_ahead": 60}])
def test_a_push_is_one_statement_that_commits_by_itself(sent, options):
    if options.pop("run_at_ahead", None):
        options["run_at"] = db_now() + timedelta(seconds=60)
    push("noop", {"n": 0})  # the queue's row and settings, read once a second
    del sent[:]
    push("noop", {"n": 1}, **options)
    assert len(sent) == 1, sent
    sql, in_transaction = sent[0]
    assert sql.startswith("INSERT") and "RETURNING" in sql and not in_transaction


@pytest.mark.usefixtures("returns_columns")
def test_the_job_returned_is_the_row_as_stored():
    job = push("noop", {"n": 1}, delay=30, priority=5, key="k1")
    row = Job.objects.get(pk=job.pk)
    assert stored(job) == stored(row) and (job.key, job.pending_key, job.pushes) == ("k1", "k1", 1)
    assert not job.merged and not job._state.adding and job._state.db == "default"
    assert (job.claims, job.started_at, job.result, job.worker, job.on_finish) == (0, None, None, "", "")
    job.priority = 7
    job.save(update_fields=["priority"])  # a Job like any other the ORM read
    assert Job.objects.get(pk=job.pk).priority == 7


def test_the_fields_a_push_does_not_read_back_hold_defaults_jobs_may_share():
    """_as_job copies one list of defaults: a mutable one would be shared by every Job."""
    defaults, places = push_module._job_layout()
    for field in Job._meta.concrete_fields:
        if field.attname not in push_module._PUSHED:
            assert isinstance(defaults[places[field.attname]], (str, int, type(None))), field.attname


def test_a_push_merges_into_the_waiting_job_of_its_key(caplog):
    first = push("noop", {"n": 1}, delay=300, key="same")
    again = push("sleepy", {"n": 2}, priority=9, key="same")
    row = Job.objects.get()
    assert again.pk == first.pk and again.merged and not first.merged
    assert stored(again) == stored(row)
    assert (row.name, row.payload, row.priority, row.pushes) == ("noop", {"n": 1}, 9, 2)
    assert row.run_at < first.run_at  # the latest push's run time wins
    assert "merged into waiting job noop" in caplog.text


def test_without_returning_a_push_upserts_and_reads_back_in_one_transaction(without_returning, sent, caplog):
    push("noop", {"n": 0})
    del sent[:]
    first = push("noop", {"n": 1}, delay=300, key="same")
    assert [in_transaction for _, in_transaction in sent] == [True] * len(sent) and len(sent) >= 2
    assert any(sql.startswith("SELECT") for sql, _ in sent)
    again = push("noop", {"n": 1}, key="same")
    assert again.pk == first.pk and again.merged and stored(again) == stored(Job.objects.get(key="same"))
    assert "merged" not in caplog.text  # the same work: nothing to warn about


def test_a_push_whose_connection_died_after_it_committed_is_not_pushed_twice(monkeypatch):
    """run() says `resumed` when an earlier try died with its connection: the job found
    waiting under its key is taken as it is."""
    run = db.run

    def lost_reply(work, using=None, attempts=8):
        run(work, using)  # the first try committed; its reply never came
        return run(lambda cursor, resumed: work(cursor, True), using)

    monkeypatch.setattr(db, "run", lost_reply)
    job = push("noop", {"n": 1})
    assert (Job.objects.count(), job.pushes, job.merged) == (1, 1, False)
    assert stored(job) == stored(Job.objects.get())


@pytest.mark.usefixtures("returns_columns")
def test_inside_a_transaction_a_push_is_seen_when_it_commits(sent):
    other = connections.create_connection("default")

    def seen() -> int:
        with other.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM leases_tasks_job")
            return cursor.fetchone()[0]

    try:
        with transaction.atomic():
            job = push("noop", {"n": 1})
            assert sent[-1][1]  # the caller's transaction
            if connection.vendor != "sqlite":  # its test database, in shared memory, locks out readers
                assert seen() == 0
        assert Job.objects.get().pk == job.pk
        if connection.vendor != "sqlite":
            assert seen() == 1
        with pytest.raises(RuntimeError), transaction.atomic():
            push("noop", {"n": 2})
            raise RuntimeError("rolled back")
        assert Job.objects.count() == 1
    finally:
        other.close()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's")
def test_the_one_statement_wakes_the_queue_of_a_due_job_only(sent):
    listener = connections.create_connection("default")
    try:
        assert db.listen(listener, CHANNEL)
        push("noop", {"n": 0}, delay=60)  # the queue's row and settings, read once a second
        push("noop", {"n": 1}, delay=60, queue="other")
        assert db.notifications(listener, 0.3) == []
        del sent[:]
        push("noop", {"n": 2})
        assert len(sent) == 1 and db.notifications(listener, 2.0) == ["default"]
        push("noop", {"n": 3}, run_at=db_now() + timedelta(seconds=60), queue="other")
        assert db.notifications(listener, 2.0) == ["other"]  # a moment given: woken, as before
    finally:
        listener.close()


@pytest.mark.parametrize("returning", [True, False])
def test_a_write_of_many_returns_the_ids_of_the_rows_it_leaves(monkeypatch, returning):
    if not returning:
        monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    elif not connection.features.can_return_columns_from_insert:
        pytest.skip("this database's INSERT returns no columns")
    waiting = push("noop", {"n": 1}, key="k1")
    jobs = [push_module.new_job("noop", {"n": n}, key=f"k{n}") for n in (1, 2, 3, 2)]  # k1 merges, k2 twice
    with CaptureQueriesContext(connection) as sent, db.write_transaction(), connection.cursor() as cursor:
        ids = push_module.write(cursor, jobs, ids=True)
    assert ids == dict(Job.objects.filter(key__in=["k1", "k2", "k3"]).values_list("key", "id"))
    assert ids["k1"] == waiting.pk and Job.objects.count() == 3
    # Where an INSERT returns columns, the upserts return the ids: no read of the keys after.
    assert any("pending_key IN" in query["sql"] for query in sent.captured_queries) is not returning
