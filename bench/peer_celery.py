"""Celery's side of bench/peers_celery.py, run by the Python of its own environment
(bench/.peers/celery, which bench/peers_celery.py makes): a drain of no-op tasks, printed as JSON.

    python -P peer_celery.py BROKER_URL drain JOBS WORKERS PROCESSES

JOBS no-op tasks are sent first, through one producer from the app's pool with the workers
down; then WORKERS `celery -A peer_celery worker` processes start, each a prefork pool of
PROCESSES children, in Celery's documented set-up for many tiny tasks: prefetch multiplier
64, acknowledgement on receipt (acks_late off), results ignored, and no gossip, mingle or
heartbeat. jobs/s = JOBS / wall time from the workers' start to the last task's end,
start-up included as on our side. The end is counted exactly and cheaply: each task appends
one byte to a file (an O_APPEND write of one byte is atomic), and the file holds JOBS bytes
once all have run; a Redis INCR would have added a broker round trip to each no-op task.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import celery
from celery import Celery

QUEUE = "bench_celery"
BROKER = os.environ.get("PEER_CELERY_BROKER", "redis://127.0.0.1:6379/5")
COUNTER = os.environ.get("PEER_CELERY_COUNTER", "")

app = Celery("peer_celery", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_acks_late=False,
    worker_prefetch_multiplier=64,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_counter_fd: list[int] = []


@app.task(name="noop")
def noop(i: int) -> None:
    """Nothing but the byte that tells the bench one more task ran."""
    if not _counter_fd:
        _counter_fd.append(os.open(COUNTER, os.O_WRONLY | os.O_APPEND))
    os.write(_counter_fd[0], b".")


def send(jobs: int) -> float:
    """Send `jobs` tasks through one pooled producer (one connection and channel for all);
    returns tasks sent a second."""
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for i in range(jobs):
            noop.apply_async((i,), producer=producer)
    return jobs / (time.perf_counter() - started)


def drain(jobs: int, workers: int, processes: int) -> dict:
    app.control.purge()  # tasks left by an interrupted run would count
    home = Path(tempfile.mkdtemp(prefix="peer_celery-"))
    # The workers import this module from a folder of its own: with bench/ on their path,
    # bench/queue.py would shadow the standard library's `queue`, which kombu imports.
    (home / "peer_celery.py").symlink_to(Path(__file__).resolve())
    counter = home / "done"
    counter.touch()
    sent = send(jobs)
    env = {**os.environ, "PYTHONPATH": str(home), "PEER_CELERY_BROKER": BROKER,
           "PEER_CELERY_COUNTER": str(counter)}
    argv = [str(Path(sys.executable).parent / "celery"), "-A", "peer_celery", "worker", "--pool", "prefork",
            "--concurrency", str(processes), "--prefetch-multiplier", "64", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--queues", QUEUE, "--loglevel", "WARNING"]
    logs = [open(home / f"worker-{n}.log", "w") for n in range(workers)]
    started = time.perf_counter()
    procs = [subprocess.Popen([*argv, "--hostname", f"bench{n}@%h"], cwd=home, env=env,
                              stdout=subprocess.DEVNULL, stderr=log) for n, log in enumerate(logs)]
    try:
        while counter.stat().st_size < jobs:
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"a Celery worker exited early; see {home}")
            if time.perf_counter() - started > 600:
                raise SystemExit(f"{counter.stat().st_size} of {jobs} tasks ran in 600 s; see {home}")
            time.sleep(0.005)
        seconds = time.perf_counter() - started
    finally:
        for proc in procs:
            proc.terminate()  # warm shutdown: nothing is left to finish
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    done = counter.stat().st_size
    shutil.rmtree(home)  # kept only when a run fails, for its logs
    return {"jobs": jobs, "done": done, "seconds": seconds, "rate": jobs / seconds, "sent_per_s": sent}


def main() -> None:
    global BROKER
    BROKER = sys.argv[1]
    app.conf.broker_url = BROKER
    what, numbers = sys.argv[2], [int(arg) for arg in sys.argv[3:]]
    result = {"drain": drain}[what](*numbers)
    result["version"] = celery.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
