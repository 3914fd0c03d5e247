"""The job queue and the pipelines beside their peers, in one run: ours on MariaDB and on
PostgreSQL, Celery on Redis and on RabbitMQ, Procrastinate on PostgreSQL.

    python bench/peers.py [--quick] [--jobs 20000] [--runs 300] [--repeat 2] [--json FILE]

Each measurement runs in processes of its own, one at a time, on this machine: ours
through bench/peer_leases.py, on the bench's own databases (``bench_peers`` on each
server); Celery through bench/peer_celery.py and Procrastinate through
bench/peer_procrastinate.py, each from its own environment ``bench/.peers/<name>``, made
on first use from requirements-<name>.txt (see ``peer_python``), Procrastinate on a
database of its own (``bench_peers_procrastinate``) on the same PostgreSQL server.

* drain: N no-op jobs sent with the workers down, then 2 worker processes started as their
  users start them, timed from their start (start-up included) to the last job's end;
  ours ``manage.py leases_worker --concurrency 64 --burst -v 0`` on each database, Celery 2
  prefork workers of 4 on each broker, Procrastinate ``procrastinate worker --one-shot``
  at each --concurrency (its best counts); statistics current on both databases;
* pipelines: R runs of 3 stages of 4 no-op tasks side by side, one stage after another,
  then a final task, started with the workers down; ours (``leases.pipelines``, the same
  2 workers) on each database, Celery's canvas ``chain(group(4), group(4), group(4),
  final)`` with the Redis result backend, on each broker; tasks/s = 13 R / wall time;
* pipeline / plain: our pipeline's tasks/s over our drain's jobs/s on the same database,
  each over its work span (first job started to last finished, the database's clock), so
  the workers' start-up, the same on both, weighs on neither;
* stage hand-over on idle workers (bench/pipelines.py's, LISTEN on PostgreSQL);
* enqueue and pickup beside Procrastinate on PostgreSQL, as bench/peer_leases.py and
  bench/peer_procrastinate.py describe.

The drains and the pipelines run in rounds, ours beside theirs, each round in the order
of the last reversed (ABBA), so a drift in the machine's load favours no side; medians.
The table goes to the terminal, the plot to bench/peers.png.
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
_HERE = Path(__file__).resolve().parent
# bench/queue.py would shadow the standard library's `queue` with bench/ on sys.path.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]

from bench.benchdb import databases, peer_python  # noqa: E402

BROKERS = {"Redis": "redis://127.0.0.1:6379/5", "RabbitMQ": "amqp://guest:guest@127.0.0.1:5672//"}
DATABASES = {"MariaDB": "mariadb", "PostgreSQL": "postgres"}
WORKERS, CELERY_PROCESSES, WIDTH, STAGES = 2, 4, 4, 3
TASKS_PER_RUN = STAGES * WIDTH + 1
GOALS = {"celery": 3.0, "procrastinate": 10.0, "canvas": 3.0, "plain": 0.5, "handover_ms": 10.0,
         "pickup_p50_ms": 5.0, "pickup_p99_ms": 20.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about two minutes (small counts, one round)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per drain (20000)")
    parser.add_argument("--runs", type=int, default=None, help="pipeline runs of 13 tasks each (300)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds of the drains and pipelines (2)")
    parser.add_argument("--concurrency", default="4,16,32", help="Procrastinate's worker concurrencies (4,16,32)")
    parser.add_argument("--handover-runs", type=int, default=None, help="runs of the hand-over test (100)")
    parser.add_argument("--pickup-jobs", type=int, default=None, help="jobs of each pickup run (200)")
    parser.add_argument("--postgres", default=databases("peers")["postgres"], help="our PostgreSQL database (%(default)s)")
    parser.add_argument("--mariadb", default=databases("peers")["mariadb"], help="our MariaDB database (%(default)s)")
    parser.add_argument("--plot", default=str(_HERE / "peers.png"), help="the PNG ('' for none)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser.parse_args()


# -- the sides ----------------------------------------------------------------------------


def measure(argv: list[str], what: str) -> dict:
    """One measurement in its own process; its last line of output is the JSON result
    (-P for the peers: bench/queue.py must not shadow `queue`)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Sides:
    """How to run one measurement on each side, from the run's arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.urls = {"MariaDB": args.mariadb, "PostgreSQL": args.postgres}
        server = args.postgres.rsplit("/", 1)[0].replace("postgres://", "postgresql://", 1)
        self.procrastinate_url = f"{server}/bench_peers_procrastinate"
        self.celery_python, self.procrastinate_python = peer_python("celery"), peer_python("procrastinate")

    def ours(self, database: str, *args: Any) -> dict:
        argv = [sys.executable, str(_HERE / "peer_leases.py"), self.urls[database], *map(str, args)]
        return measure(argv, f"ours on {database}: {args[0]}")

    def celery(self, broker: str, *args: Any) -> dict:
        argv = [str(self.celery_python), "-P", str(_HERE / "peer_celery.py"), BROKERS[broker], *map(str, args)]
        return measure(argv, f"Celery on {broker}: {args[0]}")

    def procrastinate(self, *args: Any) -> dict:
        argv = [str(self.procrastinate_python), "-P", str(_HERE / "peer_procrastinate.py"), self.procrastinate_url,
                *map(str, args)]
        return measure(argv, f"Procrastinate: {args[0]}")


def rounds(plan: dict[str, Callable[[], dict]], repeat: int) -> dict[str, list[dict]]:
    """Every measurement of `plan` once a round, each round in the order of the last
    reversed; prints each as it ends, since the run takes minutes."""
    runs: dict[str, list[dict]] = {label: [] for label in plan}
    for round_ in range(repeat):
        for label in list(plan) if round_ % 2 == 0 else list(plan)[::-1]:
            result = plan[label]()
            runs[label].append(result)
            print(f"  round {round_ + 1}  {label:<34} {result['rate']:>8,.0f}/s  ({result['seconds']:.2f} s)", flush=True)
    return runs


# -- figures --------------------------------------------------------------------------------


def median(results: list[dict], key: str = "rate") -> float:
    return statistics.median(r[key] for r in results)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else float("nan")


def handover_ms(report: dict[str, Any], database: str) -> list[float]:
    return [sample["total"] for sample in report["handover"][database]["samples"]]


def span_rate(results: list[dict], key: str) -> float:
    """Median of `key` (jobs or tasks) over the work span, start-up left out."""
    return statistics.median(r[key] / r["span"] for r in results)


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The medians, the best peer of each kind, and the ratios with their goals."""
    drain, pipes = report["drain"], report["pipelines"]
    rate = {label: median(results) for label, results in {**drain, **pipes}.items()}
    celery = max(BROKERS, key=lambda broker: rate[f"Celery, {broker}"])
    canvas = max(BROKERS, key=lambda broker: rate[f"Celery canvas, {broker}"])
    procrastinate = max((label for label in drain if label.startswith("Procrastinate")), key=rate.get)
    ratios = [
        ("drain, ours on MariaDB / Celery on its faster broker", rate["ours, MariaDB"] / rate[f"Celery, {celery}"],
         GOALS["celery"], celery),
        ("drain, ours on PostgreSQL / Celery on its faster broker",
         rate["ours, PostgreSQL"] / rate[f"Celery, {celery}"], None, celery),
        ("drain, ours on PostgreSQL / Procrastinate at its best", rate["ours, PostgreSQL"] / rate[procrastinate],
         GOALS["procrastinate"], procrastinate.split(", ", 1)[1]),
    ]
    for database in DATABASES:
        ratios.append((f"pipelines, ours on {database} / Celery canvas, faster broker",
                       rate[f"pipelines, {database}"] / rate[f"Celery canvas, {canvas}"], GOALS["canvas"], canvas))
    for database in DATABASES:
        fraction = (span_rate(pipes[f"pipelines, {database}"], "tasks")
                    / span_rate(drain[f"ours, {database}"], "jobs"))
        ratios.append((f"pipeline tasks/s / plain drain jobs/s, {database}", fraction, GOALS["plain"], "work spans"))
    return {"rate": rate, "celery": celery, "canvas": canvas, "procrastinate": procrastinate, "ratios": ratios}


# -- report ---------------------------------------------------------------------------------


def setups(report: dict[str, Any]) -> dict[str, str]:
    """Each side's set-up, as the table shows it."""
    c, p = report["versions"]["celery"], report["versions"]["procrastinate"]
    return {
        "ours": "2 x manage.py leases_worker --concurrency 64 --burst -v 0",
        "Celery": f"Celery {c}, 2 x prefork {CELERY_PROCESSES}, prefetch 64, acks on receipt",
        "Procrastinate": f"Procrastinate {p}, 2 x procrastinate worker -c N --one-shot",
        "canvas": f"Celery {c}, chain of {STAGES} groups of {WIDTH} + final, Redis results",
        "pipelines": f"leases.pipelines, {STAGES} stages x {WIDTH} + final, the same 2 workers",
    }


def samples(results: list[dict], key: str) -> str:
    """Each round's rate; for ours also the median over the work span (start-up left out)."""
    shown = ", ".join(f"{r['rate']:,.0f}" for r in results)
    return shown + (f"  (work span {span_rate(results, key):,.0f}/s)" if "span" in results[0] else "")


def print_report(report: dict[str, Any], found: dict[str, Any]) -> None:
    rate, drain, pipes, kinds = found["rate"], report["drain"], report["pipelines"], setups(report)
    print(f"\n== {'; '.join(report['databases'].values())}; {report['cores']} cores; {report['date']};"
          f" load average {report['load'][0]:.2f} at start, {report['load_end'][0]:.2f} at end;"
          f" {report['seconds']:.0f} s in all")
    print(f"\ndrain of {report['jobs']:,} no-op jobs, 2 worker processes, start-up included; median of"
          f" {report['repeat']} round(s)")
    print(f"  {'side':<26} {'set-up':<60} {'jobs/s':>8}   samples")
    for label, results in drain.items():
        kind = label.split(",")[0].split()[0]
        print(f"  {label:<26} {kinds[kind]:<60} {rate[label]:>8,.0f}   {samples(results, 'jobs')}")
    print(f"\npipelines: {report['runs']} runs x {TASKS_PER_RUN} no-op tasks ({report['runs'] * TASKS_PER_RUN:,}),"
          " workers started with the runs queued, start-up included")
    print(f"  {'side':<26} {'set-up':<60} {'tasks/s':>8}   samples")
    for label, results in pipes.items():
        kind = "canvas" if label.startswith("Celery") else "pipelines"
        print(f"  {label:<26} {kinds[kind]:<60} {rate[label]:>8,.0f}   {samples(results, 'tasks')}")
    print("\nstage hand-over on idle workers, last task of a stage finished -> next stage's first started"
          " (database clock), ms; how many the end of a stage's last task made, how many an advance event")
    for database, result in report["handover"].items():
        total = handover_ms(report, database)
        by_event = sum("event_step" in s for s in result["samples"])
        print(f"  {database:<11} p50 {percentile(total, 50):6.1f}  p99 {percentile(total, 99):6.1f}"
              f"  ({len(total)} hand-overs, {len(total) - by_event} at the task's end, {by_event} by an event;"
              f" poll {result['poll'] * 1000:.0f} ms)")
    enqueue = report["enqueue"]
    print(f"\nenqueue on PostgreSQL ({report['single']} one at a time, {report['bulk']:,} in calls of 1000),"
          " jobs/s, ours beside Procrastinate")
    for kind in ("single", "bulk"):
        mine, peer = enqueue["ours"][kind], enqueue["theirs"][kind]
        print(f"  {kind:<6}  ours {mine:>8,.0f}  Procrastinate {peer:>8,.0f}  ratio {mine / peer:5.1f}x")
    print(f"\npickup latency on PostgreSQL, {report['pickup_jobs']} jobs pushed one at a time to an idle worker"
          " (server clock), ms")
    for label, result in report["pickup"].items():
        values = [v * 1000 for v in result["latencies"]]
        print(f"  {label:<27} p50 {percentile(values, 50):6.1f}  p99 {percentile(values, 99):6.1f}  ({len(values)} jobs)")

    print(f"\n{'ratio (same run)':<66} {'value':>7}  {'goal':>7}  {'':<6} against")
    for name, value, goal, against in found["ratios"]:
        verdict = "" if goal is None else ("met" if value >= goal else "MISSED")
        shown = f"{value:.2f}" if value < 1 else f"{value:.1f}x"
        goal_text = "" if goal is None else (f">= {goal:g}" if goal < 1 else f">= {goal:g}x")
        print(f"  {name:<64} {shown:>7}  {goal_text:>7}  {verdict:<6} {against}")
    handover = percentile(handover_ms(report, "PostgreSQL"), 50)
    listened = [v * 1000 for v in report["pickup"]["ours, LISTEN/NOTIFY"]["latencies"]]
    for name, value, goal in (("stage hand-over p50 on idle workers, PostgreSQL, ms", handover, GOALS["handover_ms"]),
                              ("pickup p50, PostgreSQL, LISTEN, ms", percentile(listened, 50), GOALS["pickup_p50_ms"]),
                              ("pickup p99, PostgreSQL, LISTEN, ms", percentile(listened, 99), GOALS["pickup_p99_ms"])):
        print(f"  {name:<64} {value:>7.1f}  {'< ' + format(goal, 'g'):>7}  {'met' if value < goal else 'MISSED'}")


def plot(report: dict[str, Any], found: dict[str, Any], path: Path) -> None:
    """Drain rates, pipeline rates, and each ratio beside its goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = found["rate"]
    fig, (drains, pipes, ratios) = plt.subplots(1, 3, figsize=(15, 4.8), dpi=110,
                                                gridspec_kw={"width_ratios": [1.2, 1, 1.3]})
    for ax, labels, unit in ((drains, list(report["drain"]), "jobs/s"), (pipes, list(report["pipelines"]), "tasks/s")):
        colors = ["tab:blue" if label.startswith(("ours", "pipelines")) else "tab:gray" for label in labels]
        values = [rate[label] for label in labels]
        ax.barh(range(len(labels)), values, color=colors)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        for y, value in enumerate(values):
            ax.annotate(f" {value:,.0f}", (value, y), va="center", fontsize=7)
        ax.set_xlim(0, max(values) * 1.18)  # room for the labels
        ax.set_xlabel(f"{unit} (median), start-up included")
        ax.grid(True, axis="x", alpha=0.3)
    drains.set_title(f"drain of {report['jobs']:,} no-op jobs, 2 worker processes", fontsize=9)
    pipes.set_title(f"{report['runs']} runs of 3 stages x {WIDTH} + final", fontsize=9)
    names = [name.replace(" / ", " /\n") for name, *_ in found["ratios"]]
    values = [value for _, value, _, _ in found["ratios"]]
    goals = [goal for _, _, goal, _ in found["ratios"]]
    colors = ["tab:green" if goal is not None and value >= goal else "tab:red" if goal is not None else "tab:gray"
              for value, goal in zip(values, goals)]
    ratios.barh(range(len(values)), values, color=colors)
    for y, (value, goal) in enumerate(zip(values, goals)):
        if goal is not None:
            ratios.plot([goal, goal], [y - 0.4, y + 0.4], color="black", lw=2)
        ratios.annotate(f" {value:.2f}", (value, y), va="center", fontsize=7)
    ratios.set_yticks(range(len(values)))
    ratios.set_yticklabels(names, fontsize=7)
    ratios.invert_yaxis()
    ratios.set_xscale("log")
    ratios.set_xlim(min(values) / 1.5, max(values + [goal for goal in goals if goal is not None]) * 1.6)
    ratios.set_xlabel("ratio (black: the goal)")
    ratios.grid(True, axis="x", alpha=0.3)
    ratios.set_title("ratios, same run", fontsize=9)
    servers = "; ".join(" ".join(d.split()[:2]).split("-")[0] for d in report["databases"].values())
    fig.suptitle(f"django-leases beside its peers: {servers};"
                 f" {report['cores']} cores; {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- the run --------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    quick = args.quick
    jobs = args.jobs or (2000 if quick else 20000)
    runs = args.runs or (60 if quick else 300)
    repeat = args.repeat or (1 if quick else 2)
    handover_runs = args.handover_runs or (24 if quick else 100)
    pickup_jobs = args.pickup_jobs or (40 if quick else 200)
    single, bulk = (300, 5000) if quick else (2000, 20000)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    started = time.monotonic()
    sides = Sides(args)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
                              "load": os.getloadavg(), "jobs": jobs, "runs": runs, "repeat": repeat,
                              "single": single, "bulk": bulk, "pickup_jobs": pickup_jobs}
    print(f"{os.cpu_count()} cores; load average {report['load'][0]:.2f}", flush=True)

    report["enqueue"] = {"ours": sides.ours("PostgreSQL", "enqueue", single, bulk),
                         "theirs": sides.procrastinate("enqueue", single, bulk)}
    report["databases"] = {"PostgreSQL": report["enqueue"]["ours"]["database"]}

    print(f"\ndrain of {jobs:,} no-op jobs", flush=True)
    plan: dict[str, Callable[[], dict]] = {
        "ours, MariaDB": lambda: sides.ours("MariaDB", "drain", jobs),
        **{f"Celery, {broker}": (lambda b=broker: sides.celery(b, "drain", jobs, WORKERS, CELERY_PROCESSES))
           for broker in BROKERS},
        "ours, PostgreSQL": lambda: sides.ours("PostgreSQL", "drain", jobs),
        **{f"Procrastinate, 2 x {c}": (lambda c=c: sides.procrastinate("drain", jobs, WORKERS, c))
           for c in concurrencies},
    }
    report["drain"] = rounds(plan, repeat)
    report["databases"]["MariaDB"] = report["drain"]["ours, MariaDB"][0]["database"]

    print(f"\npipelines: {runs} runs x {TASKS_PER_RUN} tasks", flush=True)
    plan = {
        "pipelines, MariaDB": lambda: sides.ours("MariaDB", "pipeline", runs),
        **{f"Celery canvas, {broker}": (lambda b=broker: sides.celery(b, "canvas", runs, WORKERS, CELERY_PROCESSES))
           for broker in BROKERS},
        "pipelines, PostgreSQL": lambda: sides.ours("PostgreSQL", "pipeline", runs),
    }
    report["pipelines"] = rounds(plan, repeat)

    report["handover"] = {database: sides.ours(database, "handover", handover_runs) for database in DATABASES}
    report["pickup"] = {"ours, LISTEN/NOTIFY": sides.ours("PostgreSQL", "pickup", pickup_jobs, 1),
                        "Procrastinate, LISTEN/NOTIFY": sides.procrastinate("pickup", pickup_jobs),
                        "ours, polling every 50 ms": sides.ours("PostgreSQL", "pickup", pickup_jobs, 0)}
    report["versions"] = {"celery": report["drain"]["Celery, Redis"][0]["version"],
                          "kombu": report["drain"]["Celery, Redis"][0]["kombu"],
                          "procrastinate": report["enqueue"]["theirs"]["version"]}
    report["load_end"] = os.getloadavg()
    report["seconds"] = time.monotonic() - started
    found = figures(report)
    print_report(report, found)
    if args.plot:
        plot(report, found, Path(args.plot))
        print(f"\nplot: {args.plot}")
    if args.json:
        report["figures"] = found
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
