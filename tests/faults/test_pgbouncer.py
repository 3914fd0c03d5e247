"""Leases, locks and workers through PgBouncer, in its session and its transaction mode.

A PgBouncer of this module's own (a config in a temporary folder, trust auth, a free
port) stands in front of the test database's server for each mode. In session mode a
client keeps one server session, so everything works, LISTEN wake-ups included. In
transaction mode a client has a server session only for the length of a transaction:
LISTEN is not carried (a listener hears nothing, so workers run with --no-listen and
poll), and nothing may rely on session state between transactions. The engine keeps
none: locks and leases are rows, Django's psycopg backend binds parameters client-side
(no prepared statements), and the `options` startup parameter carrying lock_timeout is
dropped by PgBouncer (`ignore_startup_parameters`), as the check below shows.
"""
from __future__ import annotations

import copy
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from django.db import connection, connections
from django.db.utils import load_backend

import tests.jobs  # noqa: F401 - registers noop
from leases import Pool, db, lock
from leases.tasks import push, push_many
from leases.tasks.jobs.push import CHANNEL
from tests.conftest import Workers, database_url, wait_for
from tests.helpers import drain_and_check, pickup_seconds

PGBOUNCER = "/usr/sbin/pgbouncer"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.usefixtures("fresh_queue_settings"),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PgBouncer pools PostgreSQL"),
    pytest.mark.skipif(not os.access(PGBOUNCER, os.X_OK), reason=f"{PGBOUNCER} is not installed"),
]

class Bouncer:
    """A PgBouncer process in front of the test database's server, in `mode`.

    PgBouncer refuses to run as root: as root, its folder (in /tmp, which that user can
    reach, unlike pytest's) is handed to `postgres` and it is told to switch to that user
    (`-u`), staying in the foreground as our child."""

    def __init__(self, mode: str) -> None:
        s = connection.settings_dict
        self.mode = mode
        self.folder = folder = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{mode}-"))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        (folder / "users.txt").write_text(f'"{s["USER"]}" ""\n')
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={s['HOST'] or '127.0.0.1'} port={s['PORT'] or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {folder / 'users.txt'}\nadmin_users = {s['USER']}\n"
            f"pool_mode = {mode}\nmax_client_conn = 200\ndefault_pool_size = 20\n"
            "ignore_startup_parameters = extra_float_digits,options\n")
        argv = [PGBOUNCER, str(folder / "pgbouncer.ini")]
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (folder, *folder.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            argv[1:1] = ["-u", "postgres"]
        # Its log also goes to its stderr: a file, as a full pipe would stop it.
        with open(folder / "stderr.txt", "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"pgbouncer did not listen on {self.port}:\n{self.log()}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def log(self) -> str:
        return (self.folder / "stderr.txt").read_text()

    def show(self, what: str) -> list[dict]:
        """Rows of the admin console's SHOW `what` for the test database (simple protocol,
        the only one the console speaks: a client-side binding cursor)."""
        import psycopg

        s = connection.settings_dict
        with psycopg.connect(host="127.0.0.1", port=self.port, user=s["USER"], dbname="pgbouncer",
                             autocommit=True, cursor_factory=psycopg.ClientCursor) as admin:
            cursor = admin.execute(f"SHOW {what}")
            names = [column.name for column in cursor.description]
            rows = [dict(zip(names, row)) for row in cursor.fetchall()]
        return [row for row in rows if row["database"] == s["NAME"]]

    def url(self) -> str:
        """The test database's DATABASE_URL, through this PgBouncer."""
        url = database_url()
        direct = f":{connection.settings_dict['PORT'] or 5432}/"
        assert direct in url
        return url.replace(direct, f":{self.port}/")

    def stop(self) -> None:
        """Stop it (its server sessions end with it, so the test database can be dropped)
        and remove its folder."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module", params=["session", "transaction"])
def bouncer(request):
    running = Bouncer(request.param)
    yield running
    running.stop()


@pytest.fixture
def through(bouncer):
    """The alias "bounced": the test database through PgBouncer, for this thread only."""
    entry = copy.deepcopy(connections["default"].settings_dict)
    entry["PORT"] = str(bouncer.port)
    assert "lock_timeout" in entry["OPTIONS"]["options"]  # what PgBouncer must be told to ignore
    connections["bounced"] = load_backend(entry["ENGINE"]).DatabaseWrapper(entry, alias="bounced")
    yield "bounced"
    connections["bounced"].close()
    del connections["bounced"]


@pytest.fixture
def bounced_workers(bouncer, manage, child_env, tmp_path):
    """`leases_worker` processes whose DATABASE_URL is PgBouncer's."""
    procs = Workers(manage, {**child_env, "DATABASE_URL": bouncer.url()}, tmp_path)
    yield procs
    procs.cleanup()


def test_leases_and_locks_work_through_pgbouncer(bouncer, through):
    pool = Pool("bounced", using=through)
    pool.add_many([("a", None), ("b", None)])
    first = pool.acquire(ttl=5)
    first.renew(ttl=10)
    second = pool.acquire(ttl=5)
    assert {first.name, second.name} == {"a", "b"}
    assert first.release() and second.release()
    again = pool.acquire(ttl=5)
    assert again.token > min(first.token, second.token)
    assert again.release()
    with lock("bounced-lock", ttl=5, using=through) as held:
        held.renew()
    with lock("bounced-lock", ttl=5, using=through) as retaken:
        assert retaken.token > held.token
    assert bouncer.show("SERVERS"), "the alias did not go through PgBouncer"


def test_the_lock_timeout_startup_option_does_not_reach_the_server(bouncer, through):
    """Which is why, behind PgBouncer, lock_timeout is set for the role or the database."""
    with connections[through].cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"


def test_listen_hears_pushes_in_session_mode_only(bouncer, through):
    listener = connections[through]
    assert db.listen(listener, CHANNEL)
    push("noop", {"n": 0})  # committed on the direct connection, which notifies
    heard = db.notifications(listener, 2.0)
    if bouncer.mode == "session":
        assert heard == ["default"]
    else:
        assert heard == []  # the LISTEN went with the server session it borrowed for a moment


def test_a_worker_drains_jobs_through_pgbouncer(bouncer, bounced_workers, tmp_path):
    """Session mode: LISTEN wakes an idle worker at once although it polls every 30 s.
    Transaction mode: --no-listen, polling."""
    log = tmp_path / "runs.log"
    if bouncer.mode == "session":
        proc = bounced_workers.start("--poll", "30", "--ttl", "60")
        wait_for(lambda: "listening for pushes" in bounced_workers.stderr(proc), 30, "the worker to listen")
        time.sleep(0.5)  # past the look it takes when it starts listening
        for n in range(3):
            waited = pickup_seconds(push("noop", {"n": n, "log": str(log)}).pk)
            assert waited < 1.5, f"job {n} waited {waited:.2f}s for an idle listening worker"
        first = 3
    else:
        proc = bounced_workers.start("--no-listen")
        first = 0
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(first, 200)])
    drain_and_check(bounced_workers, [proc], log, 200, timeout=60)
    if bouncer.mode == "transaction":
        assert "listening for pushes" not in bounced_workers.stderr(proc)


@pytest.mark.parametrize("bouncer", ["transaction"], indirect=True)
def test_a_listening_worker_still_drains_by_polling_in_transaction_mode(bouncer, bounced_workers, tmp_path):
    """Without --no-listen it believes it listens (the LISTEN succeeded), hears nothing and
    polls every second instead of its --poll: slower, not stuck."""
    log = tmp_path / "runs.log"
    proc = bounced_workers.start()
    wait_for(lambda: "listening for pushes" in bounced_workers.stderr(proc), 30, "the worker to listen")
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(20)])
    drain_and_check(bounced_workers, [proc], log, 20, timeout=30)
