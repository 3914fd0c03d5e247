"""Procrastinate's side of bench/peers.py, run by the Python of its own environment
(bench/.peers/procrastinate, which bench/peers.py makes): the same work as ours, measured
the same way, printed as JSON.

    python -P peer_procrastinate.py URL enqueue SINGLE BULK
    python -P peer_procrastinate.py URL drain JOBS PROCS CONCURRENCY
    python -P peer_procrastinate.py URL pickup JOBS

URL is a database of its own on the same server as ours, made when missing; each
measurement makes Procrastinate's schema in it anew, and a drain ANALYZEs its jobs table
once they are deferred. The task is an async no-op, Procrastinate's cheapest kind. The
drain starts PROCS workers as its users start them, ``procrastinate worker --concurrency
CONCURRENCY --one-shot`` (its defaults otherwise; one-shot exits once the queue is empty,
as our ``--burst``), and times them from their start until both exit, start-up included
as on our side. Pickup latency is read off Procrastinate's own event rows ("deferred" to
"started"), both stamped by the server's clock, as ours are.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import procrastinate
import psycopg
from procrastinate import PsycopgConnector
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

QUEUE = "bench"


def make_app(url: str) -> procrastinate.App:
    app = procrastinate.App(connector=PsycopgConnector(conninfo=url))

    @app.task(name="noop", queue=QUEUE)
    async def noop(**kwargs: object) -> None:
        return None

    return app


#: The app of the workers the drain starts (`procrastinate --app=peer_procrastinate.app`).
app = make_app(os.environ.get("PEER_PROCRASTINATE_URL", ""))


def conninfo() -> str:
    return sys.argv[1]


def ensure_database() -> None:
    """The database of URL, made on the same server when missing."""
    name = conninfo_to_dict(conninfo())["dbname"]
    server = make_conninfo(conninfo(), dbname="postgres")
    with psycopg.connect(server, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))


def query(sql: str) -> list[tuple]:
    """The bench's own reads and deletes, on a plain connection beside Procrastinate's."""
    with psycopg.connect(conninfo(), autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description else []


def fresh() -> None:
    """Procrastinate's schema made anew: each measurement starts as on a new database. (On
    a table emptied by DELETE, even vacuumed, its batch_defer of 5,000 jobs ran at a third
    of its rate on a new one: fair to it, the bench never measures it there.)"""
    query("DROP SCHEMA IF EXISTS public CASCADE")
    query("CREATE SCHEMA public")
    app = make_app(conninfo())
    with app.open():
        app.schema_manager.apply_schema()


def enqueue(single: int, bulk: int) -> dict:
    app = make_app(conninfo())
    noop = app.tasks["noop"]
    fresh()
    with app.open():
        started = time.perf_counter()
        for i in range(single):
            noop.defer(i=i)
        one = single / (time.perf_counter() - started)
        started = time.perf_counter()
        for at in range(0, bulk, 1000):
            noop.batch_defer(*({"i": i} for i in range(at, min(bulk, at + 1000))))
        many = bulk / (time.perf_counter() - started)
    return {"single": one, "bulk": many}


def drain(jobs: int, procs: int, concurrency: int) -> dict:
    app = make_app(conninfo())
    fresh()
    with app.open():
        noop = app.tasks["noop"]
        for at in range(0, jobs, 1000):
            noop.batch_defer(*({"i": i} for i in range(at, min(jobs, at + 1000))))
    query("ANALYZE procrastinate_jobs")  # statistics current, as on our side (see bench/peer_leases.py)
    home = Path(tempfile.mkdtemp(prefix="peer_procrastinate-"))
    # The workers import this module from a folder of its own: with bench/ on their path,
    # bench/queue.py would shadow the standard library's `queue`.
    (home / "peer_procrastinate.py").symlink_to(Path(__file__).resolve())
    env = {**os.environ, "PYTHONPATH": str(home), "PEER_PROCRASTINATE_URL": conninfo()}
    # Warnings only, as every side of the bench runs (ours -v 0, Celery --loglevel WARNING).
    argv = [str(Path(sys.executable).parent / "procrastinate"), "--app=peer_procrastinate.app",
            "--log-level=warning", "worker",
            "--queues", QUEUE, "--concurrency", str(concurrency), "--one-shot"]
    logs = [open(home / f"worker-{n}.log", "w") for n in range(procs)]
    started = time.perf_counter()
    children = [subprocess.Popen(argv, cwd=home, env=env, stdout=log, stderr=log) for log in logs]
    codes = [child.wait(timeout=900) for child in children]
    seconds = time.perf_counter() - started
    for log in logs:
        log.close()
    if any(codes):
        raise SystemExit(f"a procrastinate worker exited with {codes}; see {home}")
    shutil.rmtree(home)  # kept only when a run fails, for its logs
    done = query("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")[0][0]
    if done != jobs:
        raise SystemExit(f"procrastinate's drain left {jobs - done} of {jobs} jobs unfinished")
    return {"jobs": jobs, "done": done, "seconds": seconds, "rate": jobs / seconds}


def _idle_worker() -> None:
    make_app(conninfo()).run_worker(queues=[QUEUE], concurrency=1, install_signal_handlers=False)


def pickup(jobs: int) -> dict:
    app = make_app(conninfo())
    fresh()
    child = multiprocessing.Process(target=_idle_worker, daemon=True)
    child.start()
    time.sleep(2)  # started and listening
    with app.open():
        noop = app.tasks["noop"]
        for i in range(jobs):
            time.sleep(random.uniform(0.01, 0.05))
            noop.defer(i=i)
    time.sleep(1)
    rows = query(
        "SELECT EXTRACT(EPOCH FROM s.at - d.at) FROM procrastinate_events d"
        " JOIN procrastinate_events s ON s.job_id = d.job_id AND s.type = 'started' WHERE d.type = 'deferred'"
    )
    child.terminate()
    child.join()
    return {"latencies": [float(row[0]) for row in rows], "jobs": jobs}


def main() -> None:
    ensure_database()
    what, numbers = sys.argv[2], [int(arg) for arg in sys.argv[3:]]
    result = {"enqueue": enqueue, "drain": drain, "pickup": pickup}[what](*numbers)
    result["version"] = procrastinate.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
