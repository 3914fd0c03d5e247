"""A worker's handler threads keep their database connection from job to job (a
connection per job costs more than a small job), and let go of one that a handler left
in a bad state, that the server dropped, or that went through an outage the process saw,
before a job's statement fails on it."""
from __future__ import annotations

import pytest
from django.db import connection, connections, transaction

from leases import outages
from leases.tasks import handler, push
from leases.tasks.models import Job, JobError
from leases.tasks.worker import JobWorker, kept

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def server_session() -> str:
    """Which database session this thread's connection is: the server's id for it, the
    driver object on SQLite."""
    if connection.vendor != "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()")
            return str(cursor.fetchone()[0])
    connection.ensure_connection()
    _SEEN.append(connection.connection)  # kept alive, so no later connection reuses its id
    return str(id(connection.connection))


_SEEN: list = []


@handler("conn.session", queue="conns", backoff=0.0)
def session(payload):
    return server_session()


@handler("conn.leave-autocommit-off", queue="conns", backoff=0.0)
def leave_autocommit_off(payload):
    name = server_session()
    transaction.set_autocommit(False)  # a handler that forgets to turn it back on
    return name


@handler("conn.end-own-session", queue="conns", backoff=0.0)
def end_own_session(payload):
    """Has the server end this thread's session, as wait_timeout or a restart would."""
    name = server_session()
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [int(name)])
            else:
                cursor.execute(f"KILL CONNECTION {int(name)}")
    finally:
        other.close()
    return name


@handler("conn.note-outage", queue="conns", backoff=0.0)
def note_outage(payload):
    """As if a statement elsewhere in the process had met a dead connection."""
    outages.lost("default")
    return server_session()


def run_jobs(names: list[str]) -> list[str]:
    """Push one job per name and run them one after another in one thread; their results,
    once each succeeded at its first attempt."""
    jobs = [push(name, {"n": n}) for n, name in enumerate(names)]
    JobWorker(queues=["conns"], concurrency=1, burst=True, poll=0.01).run()
    rows = dict(Job.objects.filter(pk__in=[job.pk for job in jobs]).values_list("pk", "result"))
    assert list(JobError.objects.values_list("message", flat=True)) == []
    assert list(Job.objects.filter(pk__in=rows).values_list("status", "attempt").distinct()) == [(Job.SUCCEEDED, 1)]
    return [rows[job.pk] for job in jobs]


def test_a_handler_thread_keeps_its_connection_from_job_to_job():
    assert connections["default"].settings_dict["CONN_MAX_AGE"] == 0  # Django's default: per request
    sessions = run_jobs(["conn.session"] * 6)
    assert len(set(sessions)) == 1, sessions


def test_a_connection_left_with_autocommit_off_is_replaced_after_the_job():
    sessions = run_jobs(["conn.session", "conn.leave-autocommit-off", "conn.session", "conn.session"])
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]


@pytest.mark.skipif(connection.vendor == "sqlite", reason="sessions a server ends")
def test_a_connection_the_server_dropped_while_idle_is_replaced_before_the_next_job(monkeypatch):
    monkeypatch.setattr(kept, "IDLE_CHECK", 0.0)  # every connection counts as idle: pinged
    sessions = run_jobs(["conn.session", "conn.end-own-session", "conn.session"])
    assert sessions[0] == sessions[1] != sessions[2]  # one try each, no failure


@pytest.mark.skipif(connection.vendor == "sqlite", reason="sessions a server ends")
def test_a_connection_the_server_ended_is_replaced_at_the_next_jobs_first_statement():
    """Not idle for long, so not pinged: its socket, readable while no reply is due, tells."""
    sessions = run_jobs(["conn.session", "conn.end-own-session", "conn.session", "conn.session"])
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]


def test_after_a_connection_lost_anywhere_in_the_process_a_thread_replaces_its_own_before_its_next_job():
    """The worker's loop notes the outage at its next statement; the thread's connection,
    which went through it too, is not used again."""
    sessions = run_jobs(["conn.session", "conn.note-outage", "conn.session", "conn.session"])
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]
