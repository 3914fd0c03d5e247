"""The pipeline engine's rates and delays beside the plain job queue's, in one run.

    python bench/pipelines.py [--database mariadb|postgres|sqlite|URL] [--quick] [--runs 500] [--repeat 2]

* throughput: R runs of a pipeline of 3 parallel stages x 4 no-op tasks, started before
  the clock starts (so each run's first stage waits in the queue), then drained by 2
  forked processes (--procs) each running ``JobWorker(concurrency=16, burst=True)`` until the
  queue is empty; tasks/s = 12 R / wall time. A task's outcome is recorded by the
  statement that ends its job, and the transaction that ends a stage's last task starts
  the next stage, or queues the run's advance event (``leases.pipelines.advance``) when
  another step holds the run; jobs/s counts those events too. Beside it the plain queue in the same processes: 12 R no-op jobs
  written with ``push_many()``, drained the same way. pipeline/plain says what the
  engine costs per task; the two alternate (ABBA) and the medians are compared;
* hand-over: the first task of a stage started minus the last task of the stage before
  finished, both as the database wrote them (the job rows' times, copied to the tasks).
  Measured on idle workers (not burst) at the default poll, runs started a few at a
  time and awaited, so it is the engine's hand-over and not a backlog; where an event
  made it, split into the wait for the advance event, the event's own step, and the
  wait for the next task. The
  same figure from the throughput runs (where the next stage queues behind the
  others) is shown too;
* for_each: one run of discover (returns ``list(range(N))``) -> a for_each stage of a
  no-op task over the N items -> a final task, on idle workers: fan out (discover
  finished -> the event that made and queued the N tasks finished, and -> the first
  item started), drain (first item started -> last finished), fan in (last item
  finished -> final task started), total (run queued -> finished); with every item
  queued at once, and again with ``max_parallel=1000``.

The database is the bench's own, never the project's DATABASE_URL: by default
``mysql://root@127.0.0.1:3306/bench_pipelines``, or ``--database sqlite`` for
``sqlite:////tmp/bench_pipelines/db.sqlite3`` (created and migrated when missing); the
bench works on its own queue and pipelines and deletes their rows before each phase and
at the end. The plot goes to bench/pipelines.png.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# The folder of this file holds queue.py, which on sys.path would shadow the standard
# library's `queue` that the worker and multiprocessing import. Keep the checkout only.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import database_version, databases, setup  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", default="mariadb",
                        help=f"mariadb, postgres, sqlite, or a DATABASE_URL (default mariadb: {databases('pipelines')['mariadb']})")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (small counts, one repeat)")
    parser.add_argument("--runs", type=int, default=None, help="runs of 3 x 4 tasks per pipeline drain (500)")
    parser.add_argument("--procs", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--concurrency", type=int, default=16, help="threads per worker process (16)")
    parser.add_argument("--repeat", type=int, default=None, help="pipeline/plain drains of each (2)")
    parser.add_argument("--latency-runs", type=int, default=None, help="runs of the hand-over test (200)")
    parser.add_argument("--latency-batch", type=int, default=4, help="runs started at a time there (4)")
    parser.add_argument("--items", type=int, default=None, help="items of the for_each (10000)")
    parser.add_argument("--max-parallel", type=int, default=None,
                        help="max_parallel of the second for_each run, 0 for none (1000)")
    parser.add_argument("--plot", default=str(_HERE / "pipelines.png"), help="the PNG ('' for none)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
setup("pipelines", ARGS.database if ARGS else None)

from django.core.management import call_command
from django.db import connections

# Loaded here, before the fork, so every worker has the engine's event handler.
import leases.pipelines.handlers  # noqa: F401
from leases.pipelines import Pipeline, Stage
from leases.pipelines.machine import EVENT
from leases.pipelines.models import Run, TaskRun
from leases.tasks import push_many
from leases.tasks import queue as jobqueue
from leases.tasks.models import Job, JobError, Queue
from leases.tasks.models import Worker as WorkerRow
from leases.tasks.registry import handler
from leases.tasks.worker import JobWorker

QUEUE = f"bench-pipelines-{os.getpid()}"
NOOP = "benchp.noop"
POLL: float = inspect.signature(JobWorker).parameters["poll"].default
STAGES, TASKS = 3, 4


def _noop(payload: Any) -> None:
    """Nothing: the bench measures the engine and the queue, not the work."""


# Handlers live here, registered before the fork, so the forked workers have them.
handler(NOOP, queue=QUEUE, max_attempts=1)(_noop)
for _s in range(1, STAGES + 1):
    for _t in range(1, TASKS + 1):
        handler(f"benchp.s{_s}t{_t}", queue=QUEUE, max_attempts=1)(_noop)
handler("benchp.item", queue=QUEUE, max_attempts=1)(_noop)
handler("benchp.final", queue=QUEUE, max_attempts=1)(_noop)


@handler("benchp.discover", queue=QUEUE, max_attempts=1)
def discover(payload: dict) -> list[int]:
    """The for_each's list: as many items as the run's context asks for."""
    return list(range(payload["context"]["items"]))


GRID = Pipeline("bench-3x4", [
    Stage(f"s{s}", [f"benchp.s{s}t{t}" for t in range(1, TASKS + 1)], parallel=True)
    for s in range(1, STAGES + 1)
])


def fan_pipeline(max_parallel: int | None) -> Pipeline:
    """discover -> one no-op task per item -> final; one definition per max_parallel."""
    return Pipeline(f"bench-fan-{max_parallel or 'all'}", [
        Stage("discover", ["benchp.discover"]),
        Stage("each", ["benchp.item"], for_each="benchp.discover", max_parallel=max_parallel),
        Stage("final", ["benchp.final"]),
    ])


def vendor() -> str:
    """mysql, postgresql or sqlite: the purge's chunked DELETE differs on MySQL."""
    return connections["default"].vendor


def purge() -> None:
    """Delete the bench's runs (stages and tasks go with them), jobs, errors and workers."""
    Run.objects.filter(pipeline__startswith="bench-").delete()
    JobError.objects.filter(job__queue=QUEUE).delete()
    with connections["default"].cursor() as cur:
        while True:  # in chunks, so no transaction grows large
            if vendor() == "mysql":
                cur.execute("DELETE FROM leases_tasks_job WHERE queue = %s LIMIT 5000", [QUEUE])
            else:
                cur.execute("DELETE FROM leases_tasks_job WHERE id IN (SELECT id FROM leases_tasks_job"
                            " WHERE queue = %s LIMIT 5000)", [QUEUE])
            if cur.rowcount < 5000:
                break
    WorkerRow.objects.filter(queues=QUEUE).delete()


# -- workers -------------------------------------------------------------------------


def worker_child(concurrency: int, burst: bool, barrier: Any, results: Any) -> None:
    """One forked worker process; a non-burst one runs until SIGTERM, as the command does."""
    try:
        worker = JobWorker(queues=[QUEUE], concurrency=concurrency, burst=burst, poll=POLL)
        signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
        worker.register()
        worker.active_queues()
        barrier.wait(timeout=60)
        worker.run()
        results.put({"end": time.monotonic(), "cpu": time.process_time()})
    except BaseException as exc:  # report instead of hanging the parent
        with contextlib.suppress(Exception):  # the barrier may be broken already
            barrier.abort()
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


class Fleet:
    """`procs` forked workers released together; `wait()` collects what they report."""

    def __init__(self, procs: int, concurrency: int, burst: bool) -> None:
        connections.close_all()  # children must not share the parent's connection
        ctx = multiprocessing.get_context("fork")
        self.barrier = ctx.Barrier(procs + 1)
        self.results = ctx.Queue()
        args = (concurrency, burst, self.barrier, self.results)
        self.children = [ctx.Process(target=worker_child, args=args) for _ in range(procs)]
        for child in self.children:
            child.start()
        self.barrier.wait(timeout=60)
        self.started = time.monotonic()

    def stop(self) -> None:
        """SIGTERM: each worker finishes what it runs and leaves, as under the command."""
        for child in self.children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGTERM)

    def wait(self, timeout: float = 600) -> dict[str, float]:
        """Wall time from the release to the last worker's exit, and their CPU time."""
        got = [self.results.get(timeout=timeout) for _ in self.children]
        for child in self.children:
            child.join()
        errors = [r["error"] for r in got if "error" in r]
        if errors:
            raise SystemExit(f"a worker failed: {errors[0]}")
        return {"wall": max(r["end"] for r in got) - self.started, "cpu": sum(r["cpu"] for r in got)}


def await_runs(ids: list[int], timeout: float, pause: float = 0.02) -> None:
    """Poll until the runs ended; one cheap indexed query per pause, so it hardly loads the server."""
    deadline = time.monotonic() + timeout
    while Run.objects.filter(pk__in=ids, status__in=Run.LIVE).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"runs still live after {timeout:.0f} s")
        time.sleep(pause)


def check_succeeded(ids: list[int]) -> None:
    """A rate of runs that failed would be meaningless: stop the bench instead."""
    left = Run.objects.filter(pk__in=ids).exclude(status=Run.SUCCEEDED)
    left = left.values_list("pk", "status", "error")[:3]
    if left:
        raise SystemExit(f"runs did not succeed: {list(left)}")


# -- throughput ----------------------------------------------------------------------


def drain_pipeline(runs: int, procs: int, concurrency: int) -> dict[str, Any]:
    """Runs started before the clock, like the plain jobs written before it: both drains time
    the workers only."""
    purge()
    begun = time.perf_counter()
    ids = [GRID.start().pk for _ in range(runs)]
    starts_per_s = runs / (time.perf_counter() - begun)
    fleet = Fleet(procs, concurrency, burst=True)
    got = fleet.wait()
    check_succeeded(ids)
    tasks = runs * STAGES * TASKS
    jobs = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    return {"tasks_per_s": tasks / got["wall"], "jobs_per_s": jobs / got["wall"], "wall": got["wall"],
            "jobs": jobs, "cpu_us_per_task": got["cpu"] / tasks * 1e6, "starts_per_s": starts_per_s,
            "handover": handovers([GRID.name])}


def drain_plain(count: int, procs: int, concurrency: int) -> dict[str, Any]:
    """The same number of no-op jobs with no engine behind them: the yardstick."""
    purge()
    push_many((NOOP, {"i": i}) for i in range(count))
    got = Fleet(procs, concurrency, burst=True).wait()
    done = Job.objects.filter(queue=QUEUE, status=Job.SUCCEEDED).count()
    if done != count:
        raise SystemExit(f"plain drain left {count - done} of {count} jobs unfinished")
    return {"tasks_per_s": count / got["wall"], "jobs_per_s": count / got["wall"], "wall": got["wall"],
            "jobs": count, "cpu_us_per_task": got["cpu"] / count * 1e6}


# -- hand-over -----------------------------------------------------------------------


def ms(delta: Any) -> float:
    return delta.total_seconds() * 1000


def secs(delta: Any) -> float:
    return delta.total_seconds()


def handovers(pipelines: list[str]) -> list[dict[str, float]]:
    """Per stage after the first of each run: the hand-over in ms, and its parts as the
    event job that ended the stage before saw them (its wait, its step, then the wait of
    the next stage's first task)."""
    stages: dict[tuple[int, int], dict[str, Any]] = {}
    rows = TaskRun.objects.filter(run__pipeline__in=pipelines).values_list(
        "run_id", "stage__position", "job_id", "started_at", "finished_at")
    for run_id, position, job_id, started, finished in rows.iterator(chunk_size=5000):
        found = stages.setdefault((run_id, position), {"first": started, "last": finished, "jobs": []})
        found["first"], found["last"] = min(found["first"], started), max(found["last"], finished)
        found["jobs"].append(job_id)
    events: dict[int, list[tuple[datetime, datetime]]] = {}
    for key, started, finished in Job.objects.filter(queue=QUEUE, name=EVENT).values_list(
            "key", "started_at", "finished_at").iterator(chunk_size=5000):
        events.setdefault(int(key.rsplit(":", 1)[1]), []).append((started, finished))
    out = []
    for (run_id, position), stage in stages.items():
        following = stages.get((run_id, position + 1))
        if following is None:
            continue
        sample = {"total": ms(following["first"] - stage["last"])}
        # The run's advance event that queued the next stage, if one did: the last to start
        # before it did, after this stage's last task ended. Without one, the transaction
        # that ended that task queued the next stage itself.
        event = max((e for e in events.get(run_id, []) if stage["last"] <= e[0] <= following["first"]),
                    key=lambda e: e[0], default=None)
        if event is not None:
            sample.update(event_wait=ms(event[0] - stage["last"]), event_step=ms(event[1] - event[0]),
                          next_wait=ms(following["first"] - event[1]))
        out.append(sample)
    return out


def bench_handover(runs: int, batch: int, procs: int, concurrency: int) -> list[dict[str, float]]:
    """Runs started `batch` at a time on idle workers, each batch awaited before the next."""
    purge()
    fleet = Fleet(procs, concurrency, burst=False)
    try:
        time.sleep(0.3)  # let the workers settle into their idle poll
        for at in range(0, runs, batch):
            ids = [GRID.start().pk for _ in range(min(batch, runs - at))]
            await_runs(ids, timeout=60)
            time.sleep(0.0137)  # a pause that does not divide the poll
    finally:
        fleet.stop()
    fleet.wait()
    check_succeeded(list(Run.objects.filter(pipeline=GRID.name).values_list("pk", flat=True)))
    return handovers([GRID.name])


# -- for_each ------------------------------------------------------------------------


def bench_fan(items: int, max_parallel: int | None, procs: int, concurrency: int) -> dict[str, Any]:
    """One for_each run on idle workers, timed from the rows it leaves."""
    purge()
    pipeline = fan_pipeline(max_parallel)
    fleet = Fleet(procs, concurrency, burst=False)
    try:
        begun = time.monotonic()
        run = pipeline.start(context={"items": items})
        await_runs([run.pk], timeout=1800, pause=0.1)
        wall = time.monotonic() - begun
    finally:
        fleet.stop()
    fleet.wait()
    check_succeeded([run.pk])
    run.refresh_from_db()
    tasks = {t.task: t for t in TaskRun.objects.filter(run=run).exclude(task="benchp.item")}
    first = tasks["benchp.discover"]
    each = TaskRun.objects.filter(run=run, task="benchp.item")
    starts = sorted(each.values_list("started_at", flat=True))
    last_end = max(each.values_list("finished_at", flat=True))
    item_jobs = Job.objects.filter(pk__in=each.values_list("job_id", flat=True))
    queued = sorted(item_jobs.values_list("enqueued_at", flat=True))
    # The advance event that made and queued the items: the run's last to start before the
    # first item job was written. A run with many events keeps only the newest
    # LEASES_KEEP_RUNS of them, so that row may be gone: its figures are then unknown.
    event = (Job.objects.filter(queue=QUEUE, name=EVENT, key=f"{EVENT}:{run.pk}", started_at__lte=queued[0])
             .order_by("-started_at").first())
    return {
        "items": items, "max_parallel": max_parallel, "wall_s": wall,
        "first_batch_inserted_s": secs(queued[min(len(queued), max_parallel or len(queued)) - 1]
                                       - first.finished_at),
        "event_wait_s": secs(event.started_at - first.finished_at) if event else None,
        "fan_out_s": secs((event.finished_at if event else starts[0]) - first.finished_at),
        "first_item_s": secs(starts[0] - first.finished_at),
        "drain_s": secs(last_end - starts[0]),
        "items_per_s": items / max(secs(last_end - starts[0]), 1e-9),
        "fan_in_s": secs(tasks["benchp.final"].started_at - last_end),
        "total_s": secs(run.finished_at - run.queued_at),
    }


# -- report --------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def spread(values: list[float]) -> str:
    """(max - min) / median of the runs."""
    if len(values) < 2:
        return "-"
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"


def pcts(samples: list[dict[str, float]], part: str = "total") -> str:
    """One line of percentiles of a hand-over part, in ms."""
    values = [s[part] for s in samples if part in s]
    if not values:
        return "no samples"
    return (f"p50 {percentile(values, 50):7.1f} | p95 {percentile(values, 95):7.1f} | "
            f"p99 {percentile(values, 99):7.1f} | max {max(values):7.1f}")


def plot(report: dict[str, Any], path: Path, title: str) -> None:
    """Rates, hand-over CDF against the poll, and the for_each phases, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, cdf, fans) = plt.subplots(1, 3, figsize=(14, 4.4), dpi=110,
                                           gridspec_kw={"width_ratios": [1, 1.4, 1.3]})
    pipe, plain = report["throughput"]["pipeline"], report["throughput"]["plain"]
    bars = [("plain queue\njobs/s", median(plain["tasks_per_s"]), "tab:gray"),
            ("pipeline\ntasks/s", median(pipe["tasks_per_s"]), "tab:blue"),
            ("pipeline jobs/s\n(with events)", median(pipe["jobs_per_s"]), "tab:cyan")]
    rates.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    for x, (_, value, _) in enumerate(bars):
        rates.annotate(f"{value:,.0f}", (x, value), ha="center", va="bottom", fontsize=8)
    rates.set_ylabel("per second (median)")
    rates.set_title(f"drain, {report['procs']} procs x {report['concurrency']}", fontsize=9)
    rates.tick_params(axis="x", labelsize=8)

    for label, samples, style in (("idle workers", report["handover_light"], "-"),
                                  ("throughput runs (backlog)", report["handover_load"], "--")):
        values = sorted(s["total"] for s in samples)
        if values:
            cdf.plot(values, [(i + 1) / len(values) for i, _ in enumerate(values)], style, label=label)
    for polls in (1, 2):
        cdf.axvline(polls * POLL * 1000, color="gray", lw=0.8, ls=":")
        label = f" {polls} poll{'s' * (polls > 1)}"
        cdf.annotate(label, (polls * POLL * 1000, 0.5), fontsize=7, color="gray")
    cdf.set_xscale("log")
    cdf.set_xlabel("stage hand-over, ms (last task finished -> next stage's first started)")
    cdf.set_ylabel("fraction of hand-overs")
    cdf.grid(True, alpha=0.3)
    cdf.legend(fontsize=8)
    cdf.set_title("stage hand-over (DB clock)", fontsize=9)

    parts = [("fan out", "fan_out_s", "tab:orange"), ("drain", "drain_s", "tab:blue"),
             ("fan in", "fan_in_s", "tab:green")]
    for row, fan in enumerate(report["for_each"]):
        left = 0.0
        for label, key, color in parts:
            fans.barh(row, fan[key], left=left, color=color, label=label if row == 0 else None)
            left += fan[key]
    fans.set_yticks(range(len(report["for_each"])))
    labels = [f"{f['items']:,} items\nmax_parallel={f['max_parallel']}" for f in report["for_each"]]
    fans.set_yticklabels(labels, fontsize=8)
    fans.set_xlabel("seconds")
    fans.legend(fontsize=8)
    fans.set_title("for_each", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_summary(report: dict[str, Any], args: argparse.Namespace) -> None:
    pipe, plain = report["throughput"]["pipeline"], report["throughput"]["plain"]
    runs, procs, threads = report["runs"], report["procs"], report["concurrency"]
    print(f"\n== summary: {report['database']}; {report['cores']} cores; {report['date']}")
    print(f"\nthroughput: {runs} runs x {STAGES} stages x {TASKS} no-op tasks ({runs * STAGES * TASKS} tasks)"
          f" vs as many plain no-op jobs; {procs} processes x {threads} threads, burst;"
          f" median of {report['repeat']} (ABBA)")
    head = (f"{'':<10} | {'tasks/s':>8} | {'jobs/s':>8} | {'wall s':>6} | {'cpu/task':>9} | spread"
            " | samples tasks/s")
    print(head)
    print("-" * len(head))
    for label, data in (("pipeline", pipe), ("plain", plain)):
        print(f"{label:<10} | {median(data['tasks_per_s']):>8,.0f} | {median(data['jobs_per_s']):>8,.0f} | "
              f"{median(data['wall']):>6.2f} | {median(data['cpu_us_per_task']):>6.0f} us | "
              f"{spread(data['tasks_per_s']):>6} | {', '.join(f'{v:,.0f}' for v in data['tasks_per_s'])}")
    ratio = median(pipe["tasks_per_s"]) / median(plain["tasks_per_s"])
    print(f"pipeline/plain tasks/s: {ratio:.2f} (goal >= 0.5); pipeline start(): "
          f"{median(pipe['starts_per_s']):,.0f} runs/s from one process, before the clock")
    print("jobs/s of the pipeline counts its event jobs too; cpu/task: user + system time of the worker"
          " processes (not the server's) per pipeline task or plain job")

    light, load = report["handover_light"], report["handover_load"]
    print("\nstage hand-over, ms (last task of a stage finished -> first task of the next started,"
          f" DB clock); worker poll {POLL} s (two polls: {2 * POLL * 1000:.0f} ms)")
    print(f"  idle workers, {args.latency_runs} runs {args.latency_batch} at a time,"
          f" {len(light)} hand-overs:")
    print(f"    {'total':<29} {pcts(light)}")
    for samples in (light, load):
        by_event = sum("event_step" in s for s in samples)
        samples_of = "idle workers" if samples is light else "throughput runs"
        print(f"    {samples_of}: {len(samples) - by_event} hand-over(s) made by the end of the stage's last task,"
              f" {by_event} by an advance event (its run was held by another step)")
    if any("event_step" in s for s in light):
        for part, text in (("event_wait", "last task end -> event start"),
                           ("event_step", "event start -> event end"),
                           ("next_wait", "event end -> next task start")):
            print(f"    {text:<29} {pcts(light, part)}")
    print(f"  throughput runs (next stage queued behind the others' tasks), {len(load)} hand-overs:")
    print(f"    {'total':<29} {pcts(load)}")

    for fan in report["for_each"]:
        first = fan["max_parallel"] or fan["items"]
        print(f"\nfor_each over {fan['items']:,} items, max_parallel={fan['max_parallel']}"
              f" ({procs} idle workers x {threads}), seconds:")
        if fan["event_wait_s"] is None:
            event = "no event (its end queued them), or its row was trimmed (LEASES_KEEP_RUNS)"
        else:
            event = (f"its event started {fan['event_wait_s']:.3f}; -> event finished (they are committed)"
                     f" {fan['fan_out_s']:.3f}")
        print(f"  fan out: discover finished -> {event}; -> first {first:,} item jobs inserted"
              f" {fan['first_batch_inserted_s']:.3f}; -> first item started {fan['first_item_s']:.3f}")
        print(f"  drain:   first item started -> last item finished {fan['drain_s']:.3f}"
              f" ({fan['items_per_s']:,.0f} items/s)")
        print(f"  fan in:  last item finished -> final task started {fan['fan_in_s']:.3f}")
        print(f"  total:   run queued -> run finished {fan['total_s']:.3f}"
              f" (wall seen by the bench {fan['wall_s']:.3f})")

    p50 = percentile([s["total"] for s in light], 50)
    at_start, at_end = (" ".join(f"{v:.2f}" for v in report[k]) for k in ("load_at_start", "load_at_end"))
    print(f"\nload average {at_start} at start, {at_end} at end (counts the bench's own processes);"
          f" {report['seconds']:.0f} s in all")
    goals = [("pipeline/plain >= 0.5", ratio >= 0.5, f"{ratio:.2f}"),
             (f"hand-over p50 <= two polls ({2 * POLL * 1000:.0f} ms)", p50 <= 2 * POLL * 1000,
              f"{p50:.1f} ms")]
    print("goals: " + "; ".join(f"{name}: {value} {'met' if ok else 'MISSED'}" for name, ok, value in goals))


def main() -> None:
    args = ARGS
    quick = args.quick
    runs = args.runs or (40 if quick else 500)
    repeat = args.repeat or (1 if quick else 2)
    args.latency_runs = args.latency_runs or (24 if quick else 200)
    items = args.items or (500 if quick else 10000)
    limit = args.max_parallel if args.max_parallel is not None else (50 if quick else 1000)
    procs, threads = args.procs, args.concurrency

    call_command("migrate", verbosity=0, interactive=False)
    if vendor() not in ("mysql", "postgresql", "sqlite"):
        raise SystemExit("use a mysql://, postgres:// or sqlite:/// DATABASE_URL")
    Queue.objects.get_or_create(name=QUEUE)
    jobqueue.forget_settings()
    version = database_version()
    load = os.getloadavg()
    print(f"database: {version}; {os.cpu_count()} cores, load average {' '.join(f'{v:.2f}' for v in load)};"
          f" queue {QUEUE}", flush=True)
    started = time.monotonic()
    report: dict[str, Any] = {"database": version, "cores": os.cpu_count(), "load_at_start": load,
                              "runs": runs, "procs": procs, "concurrency": threads, "repeat": repeat,
                              "poll": POLL, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        samples: dict[str, list[dict]] = {"pipeline": [], "plain": []}
        drains: dict[str, Callable[[], dict[str, Any]]] = {
            "pipeline": lambda: drain_pipeline(runs, procs, threads),
            "plain": lambda: drain_plain(runs * STAGES * TASKS, procs, threads),
        }
        for i in range(repeat):
            for mode in ("pipeline", "plain") if i % 2 == 0 else ("plain", "pipeline"):
                got = drains[mode]()
                samples[mode].append(got)
                print(f"  {mode} drain: {got['tasks_per_s']:,.0f} tasks/s, {got['jobs_per_s']:,.0f} jobs/s,"
                      f" {got['wall']:.2f} s", flush=True)
        report["throughput"] = {mode: {key: [s[key] for s in found] for key in found[0] if key != "handover"}
                                for mode, found in samples.items()}
        report["handover_load"] = [h for s in samples["pipeline"] for h in s["handover"]]

        report["handover_light"] = bench_handover(args.latency_runs, args.latency_batch, procs, threads)
        print(f"  hand-over on idle workers: {pcts(report['handover_light'])} ms", flush=True)

        report["for_each"] = []
        for max_parallel in [None] + ([limit] if limit else []):
            report["for_each"].append(bench_fan(items, max_parallel, procs, threads))
            print(f"  for_each max_parallel={max_parallel}: {report['for_each'][-1]['total_s']:.2f} s",
                  flush=True)
    finally:
        purge()
        Queue.objects.filter(name=QUEUE).delete()
        connections.close_all()
    report["load_at_end"] = os.getloadavg()
    report["seconds"] = time.monotonic() - started
    print_summary(report, args)
    if args.plot:
        title = f"django-leases pipelines: {version.split(',')[0]}, {report['cores']} cores, {report['date']}"
        plot(report, Path(args.plot), title)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
