"""Our side of bench/peers.py: one measurement of django-leases on one database, printed
as JSON, in a process of its own (Django is set up once per process, on one database,
and the run compares MariaDB and PostgreSQL).

    python bench/peer_leases.py DATABASE enqueue SINGLE BULK
    python bench/peer_leases.py DATABASE drain JOBS
    python bench/peer_leases.py DATABASE pipeline RUNS
    python bench/peer_leases.py DATABASE handover RUNS
    python bench/peer_leases.py DATABASE pickup JOBS LISTEN

DATABASE is mariadb, postgres or a URL (by default the bench's own ``bench_peers``).

* drain: JOBS no-op jobs pushed by ``push_many`` (calls of 1000), then 2 ``manage.py
  leases_worker --concurrency 64 --burst -v 0`` processes as an operator starts them
  (default poll; warnings only, as Celery's workers here), timed from their start until both exit, the queue empty; every job
  is checked succeeded;
* pipeline: RUNS runs of bench/peer_leases_handlers.py's pipeline started before the
  clock (each run's first stage waits in the queue), then the same 2 workers (of 64
  threads: see PIPELINE_CONCURRENCY) until both
  exit; every run is checked succeeded; tasks/s counts the pipeline's tasks (and not
  the advance events, when a run held by another step needs one between stages);
* handover: bench/pipelines.py's stage hand-over on idle workers (2 forked
  ``JobWorker`` x 16, default poll, LISTEN on PostgreSQL), RUNS runs 4 at a time;
* enqueue and pickup: ``push`` one at a time then ``push_many`` by 1000; one idle forked
  worker, jobs pushed 10 to 50 ms apart, latency from push to claim by the server's clock.

Statistics are current, as a running server keeps them: the tables of jobs, runs, stages
and tasks are vacuumed once emptied (on PostgreSQL) and ANALYZEd once the work is queued,
before the workers start.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# bench/queue.py would shadow the standard library's `queue` with bench/ on sys.path.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
setup("peers", sys.argv[1] if __name__ == "__main__" else None)

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django.db.models import Max, Min  # noqa: E402

from bench.peer_leases_handlers import NAME, PIPELINE, QUEUE, TASKS_PER_RUN  # noqa: E402
from leases.pipelines.models import Run, StageRun, TaskRun  # noqa: E402
from leases.tasks import push, push_many  # noqa: E402
from leases.tasks.models import Job, JobError  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402
from leases.tasks.worker import JobWorker  # noqa: E402

#: Threads a worker: 64, whose no-op jobs touch no connection of their own (more threads,
#: claims by the batch). A pipeline task's claim reads what its handler needs, so its
#: no-op tasks touch none either (2 x 64 of them used to pass PostgreSQL's max_connections).
WORKERS, CONCURRENCY, PIPELINE_CONCURRENCY = 2, 64, 64
#: Warnings only (-v 0), as Celery runs here (--loglevel WARNING): no line per job on either side.
WORKER_ARGV = ["leases_worker", "--queue", QUEUE, "--burst", "-v", "0",
               "--import", "bench.peer_leases_handlers"]


def tables() -> str:
    """The tables a drain or a pipeline run writes: the jobs, and the runs, stages and tasks."""
    return ", ".join(model._meta.db_table for model in (Job, Run, StageRun, TaskRun))


def purge() -> None:
    """Delete the bench's runs, jobs, errors and workers (in chunks, so no transaction
    grows large), then vacuum on PostgreSQL: each run starts without the last one's dead
    rows (autovacuum would clear them in a while; the bench cannot wait)."""
    Run.objects.filter(pipeline=PIPELINE.name).delete()
    JobError.objects.filter(job__queue=QUEUE).delete()
    while ids := list(Job.objects.filter(queue=QUEUE).values_list("id", flat=True)[:5000]):
        Job.objects.filter(id__in=ids).delete()
    WorkerRow.objects.filter(queues=QUEUE).delete()
    if connections["default"].vendor == "postgresql":
        with connections["default"].cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {tables()}")


def analyze() -> None:
    """Statistics current once the work is queued, as autovacuum would have them within a
    minute (a planner that takes a full table for empty reads every waiting job)."""
    with connections["default"].cursor() as cursor:
        if connections["default"].vendor == "postgresql":
            cursor.execute(f"ANALYZE {tables()}")
        else:
            cursor.execute(f"ANALYZE TABLE {tables()}")
            cursor.fetchall()


def run_workers(concurrency: int) -> float:
    """Seconds from the start of the workers, as users start them, until both exit."""
    analyze()
    connections.close_all()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, str(ROOT / "manage.py"), *WORKER_ARGV, "--concurrency", str(concurrency)]
    started = time.perf_counter()
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(WORKERS)]
    codes = [proc.wait(timeout=900) for proc in procs]
    seconds = time.perf_counter() - started
    if any(codes):
        raise SystemExit(f"a leases_worker exited with {codes}")
    return seconds


def span() -> float:
    """Seconds from the first job started to the last finished, by the database's clock:
    the work without the workers' start-up."""
    times = Job.objects.filter(queue=QUEUE).aggregate(first=Min("started_at"), last=Max("finished_at"))
    return (times["last"] - times["first"]).total_seconds()


def drain(jobs: int) -> dict:
    purge()
    started = time.perf_counter()
    for at in range(0, jobs, 1000):
        push_many((NAME, {"i": i}) for i in range(at, min(jobs, at + 1000)))
    sent = jobs / (time.perf_counter() - started)
    seconds = run_workers(CONCURRENCY)
    done = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    if done != jobs:
        raise SystemExit(f"our drain left {jobs - done} of {jobs} jobs unfinished")
    result = {"jobs": jobs, "seconds": seconds, "rate": jobs / seconds, "sent_per_s": sent, "span": span()}
    purge()
    return result


def pipeline(runs: int) -> dict:
    purge()
    started = time.perf_counter()
    ids = [PIPELINE.start().pk for _ in range(runs)]
    sent = runs / (time.perf_counter() - started)
    seconds = run_workers(PIPELINE_CONCURRENCY)
    failed = Run.objects.filter(pk__in=ids).exclude(status=Run.SUCCEEDED).count()
    tasks = TaskRun.objects.filter(run_id__in=ids, status=TaskRun.SUCCEEDED).count()
    if failed or tasks != runs * TASKS_PER_RUN:
        raise SystemExit(f"{failed} of {runs} runs did not succeed; {tasks} tasks of {runs * TASKS_PER_RUN}")
    jobs = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()  # the tasks and the events
    result = {"runs": runs, "tasks": tasks, "jobs": jobs, "seconds": seconds, "rate": tasks / seconds,
              "jobs_per_s": jobs / seconds, "starts_per_s": sent, "span": span()}
    purge()
    return result


def handover(runs: int) -> dict:
    """bench/pipelines.py's hand-over on idle workers, on our database. Importing it runs
    its set-up, which finds Django set up already and changes nothing but DATABASE_URL:
    put back, for the processes started later."""
    url = os.environ["DATABASE_URL"]
    from bench import pipelines

    os.environ["DATABASE_URL"] = url
    quiet()  # its set-up configured logging anew
    samples = pipelines.bench_handover(runs, 4, WORKERS, PIPELINE_CONCURRENCY)
    pipelines.purge()
    return {"runs": runs, "samples": samples, "poll": pipelines.POLL}


def enqueue(single: int, bulk: int) -> dict:
    purge()
    started = time.perf_counter()
    for i in range(single):
        push(NAME, {"i": i})
    one = single / (time.perf_counter() - started)
    started = time.perf_counter()
    push_many((NAME, {"i": i}) for i in range(single, single + bulk))
    many = bulk / (time.perf_counter() - started)
    purge()
    return {"single": one, "bulk": many}


def _idle_child(listen: bool, ready: Any) -> None:
    worker = JobWorker(queues=[QUEUE], concurrency=1, listen=listen)
    worker.register()
    ready.set()
    worker.run()


def pickup(jobs: int, listen: int) -> dict:
    """Seconds from each push to its claim, by the server's clock."""
    purge()
    connections.close_all()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_idle_child, args=(bool(listen), ready), daemon=True)
    child.start()
    ready.wait(timeout=60)
    time.sleep(2)  # listening, and past its first polls
    for i in range(jobs):
        time.sleep(random.uniform(0.01, 0.05))
        push(NAME, {"i": i})
    time.sleep(1)
    child.terminate()
    child.join()
    rows = list(Job.objects.filter(queue=QUEUE, started_at__isnull=False).values_list("enqueued_at", "started_at"))
    purge()
    return {"latencies": [(started - pushed).total_seconds() for pushed, started in rows], "jobs": jobs}


def quiet() -> None:
    """No line per job from the forked workers: their logging would be timed too."""
    logging.getLogger("leases").setLevel(logging.ERROR)


def main() -> None:
    quiet()
    call_command("migrate", verbosity=0, interactive=False)
    what, numbers = sys.argv[2], [int(arg) for arg in sys.argv[3:]]
    commands = {"enqueue": enqueue, "drain": drain, "pipeline": pipeline, "handover": handover, "pickup": pickup}
    result = commands[what](*numbers)
    result["database"] = database_version()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
