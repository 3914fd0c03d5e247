"""A crawler process with no Django project: `leases.configure(database_url=...)` and a
ResourceThread whose wait for a free resource SIGTERM ends within a second."""
from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time

import pytest

from leases import Pool
from tests.conftest import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)

# No DJANGO_SETTINGS_MODULE, no settings module, no manage.py: only the database's URL.
CHILD = """
import signal, sys
import leases
leases.configure(database_url=sys.argv[1])
from leases import ResourceThread
if sys.argv[2] == "own-handler":  # as Scrapy's: it asks the (blocked) loop for a graceful stop
    signal.signal(signal.SIGTERM, lambda signum, frame: print("own handler ran", flush=True))
thread = ResourceThread(pool="proxies", ttl=5)
print("waiting", flush=True)
thread.start()
print("started" if thread.is_alive() else "gave up", flush=True)
"""


@pytest.fixture
def exhausted():
    pool = Pool("proxies")
    pool.add_many([("p1", None), ("p2", None)])
    return [pool.acquire(ttl=60) for _ in range(2)]


def waiting_child(mode: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, database_url(), mode], cwd="/", text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={"PYTHONPATH": str(ROOT)})
    assert child.stdout.readline() == "waiting\n", child.stderr.read()
    time.sleep(1.0)  # well inside its wait
    return child


@pytest.mark.parametrize("mode, code, said", [
    ("default", -signal.SIGTERM, ""),  # the process had no handler: it dies of the signal
    ("own-handler", 0, "own handler ran\ngave up\n"),  # its handler runs once the wait has ended
])
def test_sigterm_ends_a_wait_for_a_free_resource_within_a_second(exhausted, mode, code, said):
    child = waiting_child(mode)
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=10)
    assert time.monotonic() - sent < 1.0, err
    assert child.returncode == code and out == said
    assert "SIGTERM while waiting for a resource of pool 'proxies': stopping" in err
    assert "Traceback" not in err
    assert all(lease.remaining() > 0 for lease in exhausted)  # nothing taken from their holders


def test_a_process_without_a_project_makes_the_tables_and_leases(tmp_path):
    url = f"sqlite:///{tmp_path / 'crawler.sqlite3'}"
    script = (
        "import sys, leases; leases.configure(database_url=sys.argv[1]); leases.create_tables();"
        " from leases import Pool; p = Pool('proxies'); p.add('p1', {'url': 'http://127.0.0.1:3128'});"
        " lease = p.acquire(ttl=5); print(lease.name, lease.resource['url'], lease.token)"
    )
    done = subprocess.run([sys.executable, "-c", script, url], cwd="/", capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout) == (0, "p1 http://127.0.0.1:3128 1\n"), done.stderr
    again = subprocess.run([sys.executable, "-m", "leases.setup", url], cwd="/", capture_output=True, text=True,
                           timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert again.returncode == 0 and again.stdout.startswith("tables of django-leases ready in sqlite:")


@pytest.mark.parametrize("url", ["postgres://x@h", "mysql://root@127.0.0.1:3306", "redis://h", "nonsense"])
def test_a_bad_database_url_is_one_line_and_exit_2(url):
    done = subprocess.run([sys.executable, "-m", "leases.setup", url], cwd="/", capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: database URL")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("url", [
    "sqlite:////nonexistent-folder/leases.sqlite3",
    pytest.param("mysql://app:s3cret@127.0.0.1:1/leases",
                 marks=pytest.mark.skipif(not installed("MySQLdb"), reason="mysqlclient is not installed")),
])
def test_a_database_that_cannot_be_reached_is_one_line_and_exit_75(url):
    done = subprocess.run([sys.executable, "-m", "leases.setup", url], cwd="/", capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 75 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {url.replace(':s3cret@', ':***@')}: ") and "s3cret" not in done.stderr


def test_a_url_whose_driver_is_missing_is_one_line_and_exit_2(tmp_path):
    # A driver module that cannot be imported, first on the path: as on a machine without it.
    for name in ("MySQLdb", "psycopg"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('not installed here')\n")
    for url in ("mysql://root@127.0.0.1:3306/leases", "postgres://postgres@127.0.0.1:5432/leases"):
        done = subprocess.run([sys.executable, "-m", "leases.setup", url], cwd="/", capture_output=True, text=True,
                              timeout=60, env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_an_operator_without_a_project_reads_and_lifts_bans_with_python_m_leases():
    """The Scrapy page says a ban's reason shows in `lease list`: a crawler fleet without a
    Django project has no manage.py to run it with."""
    pool = Pool("proxies")
    pool.add_many([("dc-1", None), ("dc-2", None)])
    pool.quarantine("dc-1", seconds=600, reason="ban: 403 https://example.com/x")

    def leases(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "leases", database_url(), *args], cwd="/", text=True,
                              capture_output=True, env={"PYTHONPATH": str(ROOT)}, timeout=60)

    listed = leases("lease", "list", "proxies")
    assert listed.returncode == 0, listed.stderr
    assert "ban: 403 https://example.com/x" in listed.stdout and "dc-2" in listed.stdout
    assert leases("lease", "unquarantine", "proxies", "dc-1").returncode == 0
    assert "quarantined" not in leases("lease", "list", "proxies").stdout
    wrong = leases("lease", "lsit")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
