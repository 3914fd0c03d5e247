"""Celery's side of bench/peers.py, run by the Python of its own environment
(bench/.peers/celery, which bench/peers.py makes): a drain of no-op tasks, or runs of a
canvas, printed as JSON.

    python -P peer_celery.py BROKER_URL drain JOBS WORKERS PROCESSES
    python -P peer_celery.py BROKER_URL canvas RUNS WORKERS PROCESSES

The work is sent first, through the app's pooled producer with the workers down; then
WORKERS `celery -A peer_celery worker` processes start, each a prefork pool of PROCESSES
children, in Celery's documented set-up for many tiny tasks: prefetch multiplier 64,
acknowledgement on receipt (acks_late off), and no gossip, mingle or heartbeat. The clock
runs from the workers' start (start-up included, as on our side) to the last task's end.

* drain: JOBS no-op tasks, results ignored;
* canvas: RUNS of ``chain(group(4 no-ops), group(4), group(4), final)``: each group after
  the first, and the final task, start once the group before has ended, so Celery makes
  each step a chord, which needs a result backend: Redis (``RESULT_BACKEND``), emptied
  before each measurement; the no-ops keep their results (a chord's header must), the
  final task ignores its own.

The end is counted exactly and cheaply: each task appends one byte to a file (an O_APPEND
write of one byte is atomic; ``f`` for a final task), and the file holds them all once all
have run; a Redis INCR would have added a broker round trip to each no-op task.
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
import kombu
from celery import Celery, chain, group

QUEUE = "bench_celery"
RESULT_BACKEND = "redis://127.0.0.1:6379/6"
STAGES, WIDTH = 3, 4
BROKER = os.environ.get("PEER_CELERY_BROKER", "redis://127.0.0.1:6379/5")
BACKEND = os.environ.get("PEER_CELERY_BACKEND", "")
COUNTER = os.environ.get("PEER_CELERY_COUNTER", "")

app = Celery("peer_celery", broker=BROKER, backend=BACKEND or None)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=not BACKEND,
    task_acks_late=False,
    worker_prefetch_multiplier=64,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_counter_fd: list[int] = []


def count(mark: bytes) -> None:
    """The byte that tells the bench one more task ran."""
    if not _counter_fd:
        _counter_fd.append(os.open(COUNTER, os.O_WRONLY | os.O_APPEND))
    os.write(_counter_fd[0], mark)


@app.task(name="noop")
def noop(i: int) -> None:
    """Nothing but its byte."""
    count(b".")


@app.task(name="final", ignore_result=True)
def final(i: int) -> None:
    """The run's last task: its byte tells the runs that ended."""
    count(b"f")


def canvas_of(i: int) -> chain:
    """One run: 3 groups of 4 no-ops one after another, then the final task."""
    steps = [group(noop.si(i) for _ in range(WIDTH)) for _ in range(STAGES)]
    return chain(*steps, final.si(i))


def run_workers(home: Path, counter: Path, expected: int, workers: int, processes: int) -> float:
    """Seconds from the start of the workers until `counter` holds `expected` bytes."""
    env = {**os.environ, "PYTHONPATH": str(home), "PEER_CELERY_BROKER": BROKER, "PEER_CELERY_BACKEND": BACKEND,
           "PEER_CELERY_COUNTER": str(counter)}
    argv = [str(Path(sys.executable).parent / "celery"), "-A", "peer_celery", "worker", "--pool", "prefork",
            "--concurrency", str(processes), "--prefetch-multiplier", "64", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "--queues", QUEUE, "--loglevel", "WARNING"]
    logs = [open(home / f"worker-{n}.log", "w") for n in range(workers)]
    started = time.perf_counter()
    procs = [subprocess.Popen([*argv, "--hostname", f"bench{n}@%h"], cwd=home, env=env,
                              stdout=subprocess.DEVNULL, stderr=log) for n, log in enumerate(logs)]
    try:
        while counter.stat().st_size < expected:
            if any(proc.poll() is not None for proc in procs):
                raise SystemExit(f"a Celery worker exited early; see {home}")
            if time.perf_counter() - started > 600:
                raise SystemExit(f"{counter.stat().st_size} of {expected} tasks ran in 600 s; see {home}")
            time.sleep(0.005)
        return time.perf_counter() - started
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


def measure(what: str, number: int, workers: int, processes: int) -> dict:
    """Send the work with the workers down, then time them through it."""
    app.control.purge()  # tasks left by an interrupted run would count
    if BACKEND:
        app.backend.client.flushdb()  # the last run's results and chord counters
    home = Path(tempfile.mkdtemp(prefix="peer_celery-"))
    # The workers import this module from a folder of its own: with bench/ on their path,
    # bench/queue.py would shadow the standard library's `queue`, which kombu imports.
    (home / "peer_celery.py").symlink_to(Path(__file__).resolve())
    counter = home / "done"
    counter.touch()
    started = time.perf_counter()
    with app.producer_or_acquire() as producer:
        for i in range(number):
            if what == "drain":
                noop.apply_async((i,), producer=producer)
            else:
                canvas_of(i).apply_async(producer=producer)
    sent = number / (time.perf_counter() - started)
    tasks = number if what == "drain" else number * (STAGES * WIDTH + 1)
    seconds = run_workers(home, counter, tasks, workers, processes)
    marks = counter.read_bytes()
    if what == "canvas" and marks.count(b"f") != number:
        raise SystemExit(f"{marks.count(b'f')} of {number} canvas runs ended; see {home}")
    shutil.rmtree(home)  # kept only when a run fails, for its logs
    return {"what": what, "count": number, "tasks": tasks, "done": len(marks), "seconds": seconds,
            "rate": tasks / seconds, "sent_per_s": sent}


def main() -> None:
    global BROKER, BACKEND
    BROKER, what = sys.argv[1], sys.argv[2]
    BACKEND = RESULT_BACKEND if what == "canvas" else ""
    app.conf.update(broker_url=BROKER, result_backend=BACKEND or None, task_ignore_result=not BACKEND)
    result = measure(what, *[int(arg) for arg in sys.argv[3:]])
    result.update(version=celery.__version__, kombu=kombu.__version__, backend=BACKEND or None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
