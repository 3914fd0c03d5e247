"""No `leases_worker` process dies of a database outage, however its loop meets it.

Which statement meets a dead connection first is a race with the loop's timing: a plain
read of the queues' settings once left Django's broken connection in place, and the next
unit of work built its cursor on it outside Django's error wrapping; the driver's own error
then escaped the loop and the process exited. So several workers go through several
outages: the fault proxy cutting and refusing connections, and the server ending the
workers' sessions (pg_terminate_backend, KILL CONNECTION) while they drain.
"""
from __future__ import annotations

import time

import pytest
from django.db import connection

import tests.faults.db_handlers  # noqa: F401 - registers faults.read
import tests.jobs  # noqa: F401 - registers noop
from leases.tasks import push_many
from leases.tasks.models import Job, JobError
from tests.conftest import wait_for
from tests.helpers import drain_and_check

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(autouse=True)
def a_server():
    if connection.vendor == "sqlite":
        pytest.skip("outages of a database server")


def wave(log, start: int, count: int) -> int:
    """Push jobs `start` to `start + count - 1`, each logging its runs; the next start."""
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(start, start + count)])
    return start + count


def succeeded() -> int:
    return Job.objects.filter(status=Job.SUCCEEDED).count()


def rounds(workers, procs, log, count: int, wave_size: int, fault) -> None:
    """`count` times: a wave of jobs drained, the workers idle a moment (a listening worker
    reads the queues' settings at each poll), then `fault()`; none may die of it. Then
    every job runs to its end."""
    wait_for(lambda: all("started" in workers.stderr(proc) for proc in procs), 30, "the workers to start")
    total = 0
    for _ in range(count):
        total = wave(log, total, wave_size)
        wait_for(lambda: succeeded() == total, 60, "the wave to drain")
        time.sleep(1.5)
        fault()
        assert all(proc.poll() is None for proc in procs), [workers.stderr(proc) for proc in procs]
    drain_and_check(workers, procs, log, total)


def test_six_workers_ride_out_three_outages_that_cut_and_refuse_connections(proxied_workers, proxy, tmp_path):
    procs = [proxied_workers.start("--queue", "default", "--concurrency", "4", "--ttl", "4") for _ in range(6)]

    def outage() -> None:
        proxy.refuse(8)
        time.sleep(8.5)

    rounds(proxied_workers, procs, tmp_path / "runs.log", 3, 300, outage)


def end_sessions() -> int:
    """End every session of the test database but this one, as an administrator would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND pid <> pg_backend_pid()")
            return len(cursor.fetchall())
        cursor.execute("SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()")
        ids = [row[0] for row in cursor.fetchall()]
        for session in ids:
            try:
                cursor.execute(f"KILL CONNECTION {int(session)}")
            except Exception:  # noqa: BLE001 - it ended meanwhile
                pass
        return len(ids)


def test_four_workers_ride_out_their_sessions_ended_by_the_server_five_times(workers, tmp_path):
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--ttl", "4") for _ in range(4)]

    def ended() -> None:
        assert end_sessions() >= 4
        time.sleep(1.5)

    rounds(workers, procs, tmp_path / "runs.log", 5, 200, ended)


# -- the connections the handler threads keep from job to job ---------------------------------


def reads(log, start: int, count: int, nap: float) -> int:
    """Push jobs `start` to `start + count - 1` of a handler that naps, then reads the
    database; the next start."""
    push_many([("faults.read", {"n": n, "nap": nap, "log": str(log)}) for n in range(start, start + count)])
    return start + count


def no_attempt_failed(total: int) -> None:
    """Every job succeeded at its first attempt: none failed one on a dead connection."""
    errors = list(JobError.objects.values_list("job_id", "message"))
    assert not errors, errors
    assert list(Job.objects.values_list("status", "attempt").distinct()) == [(Job.SUCCEEDED, 1)]
    assert Job.objects.count() == total


def four_threads_keep_connections(proxied_workers, log) -> tuple:
    """A worker at --concurrency 4 whose four threads each ran a job that read the
    database, so each keeps a connection (through the proxy); the worker and the next n."""
    proc = proxied_workers.start("--import", "tests.faults.db_handlers", "--concurrency", "4")
    total = reads(log, 0, 8, 0.3)  # four at a time: each thread runs two
    wait_for(lambda: succeeded() == total, 60, "the first jobs to run")
    assert len(set(Job.objects.values_list("result", flat=True))) == 4  # four threads ran them
    return proc, total


def test_after_an_outage_jobs_that_read_the_database_spend_no_attempt_on_kept_connections(
        proxied_workers, proxy, tmp_path):
    """Each thread's connection died in the outage; its next job used to fail an attempt
    with a lost connection on it (the stale connections of four threads, one job each)."""
    log = tmp_path / "runs.log"
    proc, total = four_threads_keep_connections(proxied_workers, log)
    proxy.refuse(5)
    time.sleep(5.5)
    total = reads(log, total, 16, 0.05)
    wait_for(lambda: succeeded() == total, 60, "the jobs after the outage to run")
    no_attempt_failed(total)
    drain_and_check(proxied_workers, [proc], log, total)


def test_a_connection_cut_while_its_handler_works_before_its_first_statement_is_replaced_before_it(
        proxied_workers, proxy, tmp_path):
    """The cut comes after each job began (its thread's checks passed) and before its
    handler's first statement: that statement would have failed on the dead connection."""
    log = tmp_path / "runs.log"
    proc, total = four_threads_keep_connections(proxied_workers, log)
    total = reads(log, total, 4, 2.0)
    wait_for(lambda: Job.objects.filter(status=Job.RUNNING).count() == 4, 30, "four jobs to nap")
    time.sleep(0.5)  # their threads past their checks, their handlers napping
    proxy.cut()  # every connection, the loop's too; new ones work
    wait_for(lambda: succeeded() == total, 60, "the napping jobs to run")
    no_attempt_failed(total)
    drain_and_check(proxied_workers, [proc], log, total)
