"""A worker's handler threads keep their database connection from job to job (a
connection per job costs more than a small job), and let go of one that a handler left
in a bad state or that the server dropped while it sat idle."""
from __future__ import annotations

import pytest
from django.db import connection, connections, transaction

from leases.tasks import handler, push
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from leases.tasks.worker import threads as worker_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def server_session() -> str:
    """Which database session this thread's connection is: the server's id for it on
    MySQL/MariaDB, the driver object on SQLite."""
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT CONNECTION_ID()")
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


def run_jobs(names: list[str]) -> list[str]:
    """Push one job per name and run them one after another in one thread; their results."""
    jobs = [push(name, {"n": n}) for n, name in enumerate(names)]
    JobWorker(queues=["conns"], concurrency=1, burst=True, poll=0.01).run()
    rows = dict(Job.objects.filter(pk__in=[job.pk for job in jobs]).values_list("pk", "result"))
    assert list(Job.objects.filter(pk__in=rows).values_list("status", flat=True).distinct()) == [Job.SUCCEEDED]
    return [rows[job.pk] for job in jobs]


def test_a_handler_thread_keeps_its_connection_from_job_to_job():
    assert connections["default"].settings_dict["CONN_MAX_AGE"] == 0  # Django's default: per request
    sessions = run_jobs(["conn.session"] * 6)
    assert len(set(sessions)) == 1, sessions


def test_a_connection_left_with_autocommit_off_is_replaced_after_the_job():
    sessions = run_jobs(["conn.session", "conn.leave-autocommit-off", "conn.session", "conn.session"])
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]


@pytest.mark.skipif(connection.vendor != "mysql", reason="a server-side KILL needs MySQL/MariaDB")
def test_a_connection_the_server_dropped_while_idle_is_replaced_before_the_next_job(monkeypatch):
    monkeypatch.setattr(worker_threads, "IDLE_CHECK", 0.0)  # every connection counts as idle
    killed: list[str] = []

    @handler("conn.kill-own-session", queue="conns", backoff=0.0, max_attempts=1)
    def kill_own_session(payload):
        """Ends this thread's session from another connection, as wait_timeout would."""
        name = server_session()
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute(f"KILL CONNECTION {int(name)}")
        finally:
            other.close()
        killed.append(name)
        return name

    sessions = run_jobs(["conn.session", "conn.kill-own-session", "conn.session"])
    assert killed == [sessions[1]] and sessions[0] == sessions[1] != sessions[2]  # one try, no failure
