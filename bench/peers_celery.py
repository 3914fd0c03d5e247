"""The job drain on MariaDB beside Celery on Redis and on RabbitMQ, in one run.

    python bench/peers_celery.py [--quick] [--jobs 20000] [--repeat 2] [--json FILE]

bench/peers.py is PostgreSQL's (Procrastinate's) and sets Django up on it; this bench is
MariaDB's, so it is a file of its own. Each side drains N no-op jobs preloaded, with 2
worker processes started as their users start them, start-up included:

* ours: N jobs pushed by ``push_many`` into ``bench_peers_celery``, then 2
  ``manage.py leases_worker --concurrency 16 --burst`` processes (default poll and logging);
  wall time from their start until both exit, the queue empty; every job is checked
  succeeded;
* Celery (bench/peer_celery.py, in its own environment ``bench/.peers/celery`` made on first
  use from requirements-celery.txt): N no-op tasks sent, then 2 ``celery -A ... worker``
  processes, prefork pool of 4 each (8 on 2 cores: the tasks are tiny, so more processes
  keep the cores busy while others wait on the broker), prefetch multiplier 64, early
  acknowledgement, results ignored, no gossip, mingle or heartbeat; wall time from their
  start until the N-th task has run (counted exactly, see bench/peer_celery.py); on Redis
  (``redis://127.0.0.1:6379/5``) and on RabbitMQ (``amqp://guest@127.0.0.1:5672//``).

The three runs alternate, their order turned each round, so a drift in the machine's load
favours none; the table gives each side's median and the ratio of ours to Celery's faster broker.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# bench/queue.py would shadow the standard library's `queue` with bench/ on sys.path.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, databases, peer_python, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

BROKERS = {"Redis": "redis://127.0.0.1:6379/5", "RabbitMQ": "amqp://guest:guest@127.0.0.1:5672//"}
WORKERS, OUR_CONCURRENCY, CELERY_PROCESSES = 2, 16, 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb",
                        help="our side's database: mariadb or a DATABASE_URL ("
                        + databases("peers_celery")["mariadb"] + ")")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (2,000 jobs, one round)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per drain (20000)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds of the three runs (2)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("peers_celery", ARGS.database if ARGS else None)

from django.core.management import call_command  # noqa: E402

from bench.peers_celery_handlers import NAME, QUEUE  # noqa: E402
from leases.tasks import push_many  # noqa: E402
from leases.tasks import queue as jobqueue  # noqa: E402
from leases.tasks.models import Job, JobError, Queue  # noqa: E402
from leases.tasks.models import Worker as WorkerRow  # noqa: E402

# -- Celery's side ----------------------------------------------------------------------


def celery_drain(broker: str, jobs: int) -> dict:
    """One drain on Celery's side (-P: bench/queue.py must not shadow `queue`)."""
    argv = [str(peer_python("celery")), "-P", str(_HERE / "peer_celery.py"), broker, "drain",
            str(jobs), str(WORKERS), str(CELERY_PROCESSES)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"celery drain on {broker} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- our side ---------------------------------------------------------------------------


def purge() -> None:
    """Delete the bench queue's jobs, errors and worker rows."""
    JobError.objects.filter(job__queue=QUEUE).delete()
    while Job.objects.filter(queue=QUEUE).exists():  # in chunks, so no transaction grows large
        ids = list(Job.objects.filter(queue=QUEUE).values_list("id", flat=True)[:5000])
        Job.objects.filter(id__in=ids).delete()
    WorkerRow.objects.filter(queues=QUEUE).delete()


def our_drain(jobs: int) -> dict:
    """N jobs pushed, then the workers as an operator starts them, timed until both exit."""
    purge()
    started = time.perf_counter()
    for at in range(0, jobs, 1000):
        push_many((NAME, {"i": i}) for i in range(at, min(jobs, at + 1000)))
    sent = jobs / (time.perf_counter() - started)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, str(ROOT / "manage.py"), "leases_worker", "--queue", QUEUE, "--concurrency",
            str(OUR_CONCURRENCY), "--burst", "--import", "bench.peers_celery_handlers"]
    started = time.perf_counter()
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(WORKERS)]
    codes = [proc.wait(timeout=600) for proc in procs]
    seconds = time.perf_counter() - started
    if any(codes):
        raise SystemExit(f"a leases_worker exited with {codes}")
    done = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    if done != jobs:
        raise SystemExit(f"our drain left {jobs - done} of {jobs} jobs unfinished")
    purge()
    return {"jobs": jobs, "done": done, "seconds": seconds, "rate": jobs / seconds, "sent_per_s": sent}


# -- the run ----------------------------------------------------------------------------


def main() -> None:
    args = ARGS
    jobs = args.jobs or (2000 if args.quick else 20000)
    repeat = args.repeat or (1 if args.quick else 2)
    call_command("migrate", verbosity=0, interactive=False)
    Queue.objects.get_or_create(name=QUEUE)
    jobqueue.forget_settings()
    peer_python("celery")
    version = database_version()
    print(f"{version}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"drain of {jobs:,} no-op jobs, {WORKERS} worker processes, start-up included, jobs/s", flush=True)
    runs: dict[str, list[dict]] = {"ours": [], **{f"Celery, {name}": [] for name in BROKERS}}
    sides = list(runs)
    for round_ in range(repeat):
        for side in sides[round_ % len(sides):] + sides[:round_ % len(sides)]:  # the order turned each round
            if side == "ours":
                result = our_drain(jobs)
            else:
                result = celery_drain(BROKERS[side.removeprefix("Celery, ")], jobs)
            runs[side].append(result)
            print(f"  round {round_ + 1}  {side:<18} {result['rate']:>7,.0f} jobs/s"
                  f"  ({result['seconds']:.2f} s;"
                  f" sent at {result['sent_per_s']:,.0f}/s)", flush=True)
    rates = {side: statistics.median(r["rate"] for r in results) for side, results in runs.items()}
    celery_version = runs[sides[1]][0]["version"]
    best = max(sides[1:], key=rates.get)
    print(f"\n{'side':<20} {'set-up':<52} {'jobs/s':>8}")
    setups = {"ours": f"2 x manage.py leases_worker --concurrency {OUR_CONCURRENCY} --burst"}
    for name in BROKERS:
        setups[f"Celery, {name}"] = f"Celery {celery_version}, 2 x prefork {CELERY_PROCESSES}, prefetch 64"
    for side in sides:
        print(f"{side:<20} {setups[side]:<52} {rates[side]:>8,.0f}")
    ratio = rates["ours"] / rates[best]
    goal = "met" if ratio >= 3 else "MISSED"
    print(f"\nratio ours / {best} (Celery's faster here): {ratio:.2f}x; goal 3x: {goal}")
    Queue.objects.filter(name=QUEUE).delete()
    if args.json:
        report = {"database": version, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "jobs": jobs,
                  "setups": setups, "runs": runs, "median": rates, "ratio": ratio, "best_celery": best}
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
