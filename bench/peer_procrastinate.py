"""Procrastinate's side of bench/peers.py, run by the Python of its own environment
(bench/peers.py makes it): the same work as ours, measured the same way, printed as JSON.

    python peer_procrastinate.py URL enqueue SINGLE BULK
    python peer_procrastinate.py URL drain JOBS PROCS CONCURRENCY
    python peer_procrastinate.py URL pickup JOBS

URL is a database of its own on the same server (bench/peers.py creates it); each
measurement makes Procrastinate's schema in it anew, and a drain ANALYZEs its jobs table
once they are deferred. The
task is an async no-op, Procrastinate's cheapest kind; workers run with its defaults but
for `wait=False` in the drain (exit once the queue is empty, as our `burst`). Pickup
latency is read off Procrastinate's own event rows ("deferred" to "started"), both
stamped by the server's clock, as ours are.
"""
from __future__ import annotations

import json
import multiprocessing
import random
import sys
import time

import procrastinate
import psycopg
from procrastinate import PsycopgConnector

QUEUE = "bench"


def make_app(url: str) -> procrastinate.App:
    app = procrastinate.App(connector=PsycopgConnector(conninfo=url))

    @app.task(name="noop", queue=QUEUE)
    async def noop(**kwargs: object) -> None:
        return None

    return app


def conninfo() -> str:
    return sys.argv[1]


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


def _worker(concurrency: int, barrier: multiprocessing.Barrier) -> None:
    app = make_app(conninfo())
    barrier.wait()
    app.run_worker(queues=[QUEUE], concurrency=concurrency, wait=False, install_signal_handlers=False)


def drain(jobs: int, procs: int, concurrency: int) -> dict:
    app = make_app(conninfo())
    fresh()
    with app.open():
        noop = app.tasks["noop"]
        for at in range(0, jobs, 1000):
            noop.batch_defer(*({"i": i} for i in range(at, min(jobs, at + 1000))))
    query("ANALYZE procrastinate_jobs")  # statistics current, as on our side (see bench/peers.py)
    barrier = multiprocessing.Barrier(procs + 1)
    children = [multiprocessing.Process(target=_worker, args=(concurrency, barrier)) for _ in range(procs)]
    for child in children:
        child.start()
    barrier.wait()
    started = time.perf_counter()
    for child in children:
        child.join()
    seconds = time.perf_counter() - started
    done = query("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")[0][0]
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
    what, numbers = sys.argv[2], [int(arg) for arg in sys.argv[3:]]
    result = {"enqueue": enqueue, "drain": drain, "pickup": pickup}[what](*numbers)
    result["version"] = procrastinate.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
