"""A push whose reply is lost makes one job per call, even when a worker starts that job
before the push's retry gets through.

The retry used to look the job up by its key: the job had been claimed meanwhile, so none
waited under the key, and the retry inserted a second job (both ran). Now it finds its
own row by the id the push chose. Here the test pushes through the fault proxy, which
loses the reply of the push's statement (or of the COMMIT of a `push_many` batch) and then
refuses connections, as an outage would, until a `leases_worker` (default options,
connected directly) has run the job.
"""
from __future__ import annotations

import math
import threading

import pytest
from django.db import connection, connections

import tests.jobs  # noqa: F401 - registers noop
from leases.tasks import push, push_many
from leases.tasks.models import Job, Queue
from tests.conftest import wait_for
from tests.helpers import drain_and_check, log_lines

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow,
              pytest.mark.usefixtures("fresh_queue_settings")]

#: The push's own statement: the upsert (one autocommitted statement where an INSERT
#: returns columns, as on MariaDB and PostgreSQL).
INSERT = r'^\s*INSERT INTO [`"]?leases_tasks_job\b'
#: What commits a push_many batch, after its upsert (or, on PostgreSQL, its notification).
COMMIT = r"^\s*COMMIT\b"
BATCH = r'INSERT INTO [`"]?leases_tasks_job\b|pg_notify'


@pytest.fixture(autouse=True)
def a_server_behind_the_proxy():
    if connection.vendor == "sqlite":
        pytest.skip("the fault-injection proxy stands in front of a server")


@pytest.fixture
def outage_until(proxy):
    """`outage_until(rule, ran)`: in a thread, once `rule` has lost its reply (and the proxy
    refuses connections), wait for `ran()` to hold, then end the outage; returns the
    thread's errors, filled once it is joined."""
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []

    def start(rule, ran) -> list[BaseException]:
        def watch() -> None:
            try:
                wait_for(lambda: rule.dropped, 30, "the reply to be lost")
                wait_for(ran, 30, "a worker to run the job during the outage")
            except BaseException as exc:  # noqa: BLE001 - pytest.fail's exception too: reported by the test
                errors.append(exc)
            finally:
                proxy.allow()
                connections.close_all()

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        threads.append(thread)
        return errors

    yield start
    for thread in threads:
        thread.join(40)


def succeeded(**lookup) -> bool:
    return Job.objects.filter(status=Job.SUCCEEDED, **lookup).exists()


def test_a_push_whose_reply_is_lost_while_a_worker_runs_its_job_makes_one_job(workers, proxy, proxied,
                                                                            outage_until, tmp_path):
    log = tmp_path / "runs.log"
    proc = workers.start()
    rule = proxy.drop_reply(INSERT, count=1, refuse=math.inf)
    errors = outage_until(rule, lambda: succeeded(key="once"))
    job = push("noop", {"n": 0, "log": str(log)}, key="once", using=proxied)
    assert rule.dropped == 1 and not errors, errors
    rows = list(Job.objects.filter(key="once").values_list("pk", "status", "pushes"))
    assert rows == [(job.pk, Job.SUCCEEDED, 1)]  # one job, the one returned, and it ran
    assert not job.merged
    runs = drain_and_check(workers, [proc], log, 1)
    assert runs == {0: 1}


def test_a_push_merged_into_a_waiting_job_whose_reply_is_lost_neither_merges_twice_nor_adds_a_job(
        workers, proxy, proxied, outage_until, tmp_path):
    log = tmp_path / "runs.log"
    first = push("noop", {"n": 0, "log": str(log)}, key="once", delay=3600)
    proc = workers.start()
    rule = proxy.drop_reply(INSERT, count=1, refuse=math.inf)
    errors = outage_until(rule, lambda: succeeded(key="once"))
    again = push("noop", {"n": 0, "log": str(log)}, key="once", using=proxied)  # due now: merged, then run
    assert rule.dropped == 1 and not errors, errors
    rows = list(Job.objects.filter(key="once").values_list("pk", "status", "pushes"))
    assert rows == [(first.pk, Job.SUCCEEDED, 2)]  # merged once, into the job that ran
    assert again.pk == first.pk and again.merged
    runs = drain_and_check(workers, [proc], log, 1)
    assert runs == {0: 1}


def test_a_push_that_moves_the_waiting_job_of_its_key_in_a_full_queue_counts_once_and_survives_a_lost_reply(
        workers, proxy, proxied, outage_until, tmp_path):
    """A full queue takes no new job, but a push of a waiting job's key moves that job. It
    used to move it and then merge into it too (pushes counted twice); and after a lost
    reply, the job started meanwhile, the retry found nothing to move and the push failed
    with QueueFull although it had moved the job."""
    log = tmp_path / "runs.log"
    Queue.objects.create(name="default", max_length=1)
    first = push("noop", {"n": 0, "log": str(log)}, key="once", delay=3600)  # the queue is full
    proc = workers.start()
    rule = proxy.drop_reply(r"^\s*UPDATE \S+ SET run_at", count=1, refuse=math.inf)
    errors = outage_until(rule, lambda: succeeded(key="once"))
    moved = push("noop", {"n": 0, "log": str(log)}, key="once", using=proxied)
    assert rule.dropped == 1 and not errors, errors
    rows = list(Job.objects.filter(key="once").values_list("pk", "status", "pushes"))
    assert rows == [(first.pk, Job.SUCCEEDED, 2)]
    assert moved.pk == first.pk and moved.merged
    runs = drain_and_check(workers, [proc], log, 1)
    assert runs == {0: 1}


def test_a_push_many_batch_whose_commit_reply_is_lost_while_workers_run_it_is_written_once(
        workers, proxy, proxied, outage_until, tmp_path):
    log = tmp_path / "runs.log"
    total = 20
    proc = workers.start()
    rule = proxy.drop_reply(COMMIT, count=1, after=BATCH, refuse=math.inf)
    errors = outage_until(rule, lambda: succeeded())
    assert push_many([("noop", {"n": n, "log": str(log)}) for n in range(total)], using=proxied) == total
    assert rule.dropped == 1 and not errors, errors
    assert Job.objects.count() == total and set(Job.objects.values_list("pushes", flat=True)) == {1}
    runs = drain_and_check(workers, [proc], log, total)
    assert set(runs.values()) == {1}
    assert {pid for _, pid in log_lines(log)} == {proc.pid}


def plan(statement: str, params: list) -> str:
    """The database's plan for `statement`, as text. PostgreSQL is told to avoid a scan of
    the table where an index can serve (its tables here are too small to need one)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET enable_seqscan = off")
            cursor.execute("EXPLAIN " + statement, params)
            text = "\n".join(row[0] for row in cursor.fetchall())
            cursor.execute("RESET enable_seqscan")
            return text
        cursor.execute("ANALYZE TABLE leases_tasks_job")
        cursor.fetchall()
        cursor.execute("EXPLAIN " + statement, params)
        columns = [c[0] for c in cursor.description]
        return "\n".join(str(dict(zip(columns, row))) for row in cursor.fetchall())


def test_a_push_looks_its_row_up_through_the_dedupe_key_index():
    from leases.sql import in_list, statements

    push_many([("noop", {"n": n}) for n in range(3000)])
    Job.objects.filter(pk__lte=Job.objects.order_by("pk")[2000].pk).update(
        status=Job.SUCCEEDED, pending_key=None, finished_at=Job.objects.first().enqueued_at)
    st = statements(connection, "job")
    keys = list(Job.objects.values_list("key", flat=True)[:3])
    for shown in (plan(st.pushed_by, [keys[0], 7, 7]),
                  plan(st.pushed_among + in_list(keys) + st.pushed_among_tail, [7, 7, *keys])):
        assert "leases_job_key" in shown, shown
