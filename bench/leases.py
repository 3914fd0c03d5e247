"""Acquire+release pairs per second: the public API beside the same protocol in raw SQL,
and how both scale with the pool's size.

    python bench/leases.py [--seconds 5] [--procs 1,4,8] [--repeat 2] [--sizes 40,10000,1000000]
                           [--plot bench/leases.png] [--json out.json]

Each configuration forks N processes (each opens its own connection), lets them warm up,
then runs them together for a fixed time. A pair is one acquisition and its release:

* api: ``Pool(name).acquire(ttl=60)`` then ``lease.release()`` through Django;
* raw: the protocol's three statements (candidates SELECT of the few rows free longest,
  tried in random order; conditional claim UPDATE on the token read, trying the next
  candidate when it loses; release UPDATE by id/token/holder) on a raw DB-API
  connection: MySQLdb with FOUND_ROWS and autocommit, psycopg 3 in autocommit, or sqlite3
  with the project's busy timeout and WAL;
* old (pool-size axis only): the raw loop with the first design's candidates, every free
  row sorted by RAND(), beside the others at the sizes where it finishes.

The pool-size axis (`--sizes`) runs api and raw with 1 and 8 processes on pools of each
size (and old up to OLD_MAX rows), and plots pairs/s against the size (`--plot`).

Raw and api runs alternate in an ABBA order (raw, api, api, raw, ...) so both see the
same machine state and a drift in the background load favours neither; the table reports
the median of `--repeat` runs of each, and the client CPU time per pair (user + system
time of the bench processes over the measured window, median of the runs): on a busy
machine that number moves much less than the pairs per second.

The database is DATABASE_URL, as for the project; the bench migrates it, works on its
own pools (``bench-...``) and deletes their rows at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The script's own folder comes first on sys.path, and this file is named leases.py:
# drop that folder so that `import leases` finds the app, and put the checkout first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (_HERE, ROOT)]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402

from bench.benchdb import database_version  # noqa: E402
from bench.leaseloops import RAW_SQL, run_once, vendor  # noqa: E402
from leases import Pool  # noqa: E402
from leases.models import Resource  # noqa: E402

#: The largest pool the old design (every free row sorted by RAND()) is run on: at a
#: million rows one of its pairs takes seconds.
OLD_MAX = 10_000
#: Process counts of the pool-size axis.
SIZE_PROCS = (1, 8)
#: Pool size of the main runs: 8 processes rarely pick the same row out of 64.
BIG_POOL = 64
#: Contended case: 8 processes on 4 resources, waiting up to WAIT seconds.
SMALL_POOL, CONTENDED_PROCS, WAIT = 4, 8, 5.0

# -- set-up and clean-up in the parent -------------------------------------------------


def still_held(pool: str) -> int:
    from leases.clock import db_now

    return Resource.objects.filter(pool=pool, busy_before__gt=db_now()).count()


def commit_policy() -> str:
    """What a commit waits for: with a flush per commit, one process is bound by the disk."""
    conn = connections["default"]
    if conn.vendor == "sqlite":
        with conn.cursor() as cur:
            cur.execute("PRAGMA journal_mode")
            mode = cur.fetchone()[0]
            cur.execute("PRAGMA synchronous")
            sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(cur.fetchone()[0], "?")
        return f"journal_mode={mode}, synchronous={sync}"
    if conn.vendor == "postgresql":
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('synchronous_commit'), current_setting('fsync')")
            sync, fsync = cur.fetchone()
        return f"synchronous_commit={sync}, fsync={fsync}"
    with conn.cursor() as cur:
        cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
        flush = cur.fetchone()[0]
    meaning = {0: "no log flush at commit", 1: "a log flush to disk per commit",
               2: "log written, not flushed, per commit"}.get(int(flush), "")
    return f"innodb_flush_log_at_trx_commit={flush} ({meaning})"


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores' worth of CPU the whole machine used over `seconds` (Linux /proc/stat), or None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return sum(ticks[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (total - (idle1 - idle0)) / total * (os.cpu_count() or 1) if total > 0 else None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: list[float]) -> str:
    """Relative range of the samples: (max - min) / median."""
    if len(values) < 2:
        return "-"
    return f"{(max(values) - min(values)) / statistics.median(values) * 100:.0f}%"


def parse_args() -> tuple[argparse.Namespace, list[int]]:
    """The options, and the process counts of the main runs (checked here, so a typo
    fails before the bench fills any table)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per run (5)")
    parser.add_argument("--warmup", type=float, default=0.5, help="warm-up per run (0.5)")
    parser.add_argument("--procs", default="1,4,8", help="process counts (1,4,8)")
    parser.add_argument("--repeat", type=int, default=2, help="raw/api runs per configuration (2)")
    parser.add_argument("--no-contended", action="store_true",
                        help=f"skip the contended case ({CONTENDED_PROCS} processes, pool of {SMALL_POOL})")
    parser.add_argument("--sizes", default="40,10000,1000000",
                        help="pool sizes of the size axis, '' for none (40,10000,1000000)")
    parser.add_argument("--plot", default=str(_HERE / "leases.png"), help="the size axis's PNG ('' for none)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    procs_list = [int(p) for p in args.procs.split(",") if p.strip()]
    if not procs_list or min(procs_list) < 1 or args.repeat < 1 or args.seconds <= 0:
        parser.error("need --procs >= 1, --repeat >= 1 and --seconds > 0")
    return args, procs_list


def check_database() -> str:
    """Migrate, and refuse a database the raw statements are not written for; the vendor."""
    call_command("migrate", verbosity=0, interactive=False)
    vendor_ = vendor()
    if vendor_ not in RAW_SQL:
        raise SystemExit(f"no raw SQL for {vendor_!r}: use a mysql://, postgres:// or sqlite:/// DATABASE_URL")
    assert Resource._meta.db_table == "leases_resource", "the raw statements name the table"
    return vendor_


def make_pools() -> tuple[str, str]:
    """The main runs' pools (BIG_POOL and SMALL_POOL resources), named for this run so
    that they never meet another bench's rows."""
    tag = f"bench-{os.getpid()}-{secrets.token_hex(3)}"
    big, small = f"{tag}-{BIG_POOL}", f"{tag}-{SMALL_POOL}"
    Pool(big).add_many((f"r{i:03d}", {"n": i}) for i in range(BIG_POOL))
    Pool(small).add_many((f"r{i:03d}", {"n": i}) for i in range(SMALL_POOL))
    return big, small


def busy_text(busy: float | None) -> str:
    """The CPU other jobs used before the first run, as the reports put it ('' if unknown)."""
    return f"{busy:.1f} cores busy over 1 s before the first run, " if busy is not None else ""


def print_machine(vendor_: str, cores: int | None, args: argparse.Namespace) -> tuple[float, float | None]:
    """Print the machine's state and the runs' settings; returns the load average and the
    busy cores measured before the first run, which the end of the report compares."""
    sharing = "with each other" if vendor_ == "sqlite" else "with each other and the database server"
    load_start = os.getloadavg()[0]
    busy = busy_cores()
    print(f"machine: {cores} cores, so runs with more processes than cores share the CPU {sharing}; "
          f"{busy_text(busy)}load average {load_start:.2f} (other jobs skew results)", flush=True)
    print(f"each run: {args.warmup:g}s warm-up, {args.seconds:g}s measured; "
          f"raw and api interleaved (ABBA), median of {args.repeat}", flush=True)
    return load_start, busy


def measure(procs: int, pool: str, wait: float, contended: bool, args: argparse.Namespace) -> dict:
    """One configuration's row: `--repeat` raw and api runs in ABBA order and their medians;
    prints every run's rate as it goes, since a full bench takes minutes."""
    samples: dict[str, list[dict]] = {"raw": [], "api": []}
    for i in range(args.repeat):
        # ABBA: raw, api, api, raw, ... so a steady drift of the load cancels out
        for mode in ("raw", "api") if i % 2 == 0 else ("api", "raw"):
            samples[mode].append(run_once(mode, pool, procs, wait, args.warmup, args.seconds))
    raw = [s["pairs_per_s"] for s in samples["raw"]]
    api = [s["pairs_per_s"] for s in samples["api"]]
    raw_cpu = [s["cpu_us_per_pair"] for s in samples["raw"]]
    api_cpu = [s["cpu_us_per_pair"] for s in samples["api"]]
    label = f"{procs} (pool {SMALL_POOL}, wait {wait:g}s)" if contended else f"{procs}"
    row = {
        "procs": procs,
        "pool_size": SMALL_POOL if contended else BIG_POOL,
        "wait": wait,
        "label": label,
        "raw_pairs_per_s": median(raw),
        "api_pairs_per_s": median(api),
        "ratio": median(api) / median(raw) if median(raw) else float("nan"),
        "raw_cpu_us_per_pair": median(raw_cpu),
        "api_cpu_us_per_pair": median(api_cpu),
        "raw_samples": raw,
        "api_samples": api,
        "raw_runs": samples["raw"],
        "api_runs": samples["api"],
    }
    print(f"  {label}: raw {', '.join(f'{v:.0f}' for v in raw)} | "
          f"api {', '.join(f'{v:.0f}' for v in api)} pairs/s; client cpu/pair "
          f"raw {', '.join(f'{v:.0f}' for v in raw_cpu)} | "
          f"api {', '.join(f'{v:.0f}' for v in api_cpu)} us", flush=True)
    return row


def print_table(rows: list[dict], title: str) -> None:
    """The main runs' table, then what went wrong in them: acquisitions that found no free
    resource, and claims that lost a race (raw only: the API does not show them)."""
    head = (f"{'procs':<24} | {'raw pairs/s':>11} | {'api pairs/s':>11} | {'api/raw':>7} | "
            f"raw spread | api spread | raw cpu/pair | api cpu/pair")
    print()
    print(title)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['label']:<24} | {r['raw_pairs_per_s']:>11.0f} | {r['api_pairs_per_s']:>11.0f} | "
              f"{r['ratio']:>7.2f} | {spread(r['raw_samples']):>10} | {spread(r['api_samples']):>10} | "
              f"{r['raw_cpu_us_per_pair']:>9.0f} us | {r['api_cpu_us_per_pair']:>9.0f} us")
    print("spread: (max - min) / median of the runs; cpu/pair: user + system time of the bench "
          "processes per pair (the database server's time is not included)")
    for r in rows:
        extra = []
        for mode in ("raw", "api"):
            failed = sum(s["failed"] for s in r[f"{mode}_runs"])
            lost = [s["lost_claims"] for s in r[f"{mode}_runs"]]
            if failed:
                extra.append(f"{mode}: {failed} acquisitions found no free resource")
            if None not in lost and sum(lost):
                extra.append(f"{mode}: {sum(lost)} claims lost a race")
        if extra:
            print(f"  {r['label']}: " + "; ".join(extra))


def print_load(load_start: float, busy: float | None, cores: int | None, leftover: int, deleted: int) -> None:
    """The load before and after and the clean-up; a note when other jobs were busy
    before the first run, whose results then say less."""
    print(f"load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (that one counts the "
          f"bench's own processes); {leftover} resources left held; {deleted} bench rows deleted")
    if cores and (busy if busy is not None else load_start) > cores / 4:
        print(f"note: other jobs were using the machine before the first run ({busy_text(busy)}load average "
              f"{load_start:.2f} on {cores} cores): compare the spreads, and prefer more --repeat on a "
              "quiet machine")


def main() -> None:
    """The main runs, then the pool-size axis; their tables, the plot and the JSON."""
    args, procs_list = parse_args()
    vendor_ = check_database()
    big, small = make_pools()
    version = database_version(flush=False)
    policy = commit_policy()
    cores = os.cpu_count()

    configs = [(p, big, 0.0) for p in procs_list]
    if not args.no_contended:
        configs.append((CONTENDED_PROCS, small, WAIT))

    print(f"database: {version} ({vendor_}), {policy}; pools {big} and {small}", flush=True)
    load_start, busy = print_machine(vendor_, cores, args)

    try:
        rows = [measure(procs, pool, wait, pool != big, args) for procs, pool, wait in configs]
        leftover = still_held(big) + still_held(small)
    finally:
        deleted, _ = Resource.objects.filter(pool__in=[big, small]).delete()
        connections.close_all()

    print_table(rows, f"{version}, {policy}; {cores} cores, {args.seconds:g}s per run, median of {args.repeat}")
    print_load(load_start, busy, cores, leftover, deleted)

    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    axis = size_axis(sizes, args) if sizes else []
    if axis and args.plot:
        plot(axis, Path(args.plot), f"{version}, {cores} cores, {time.strftime('%Y-%m-%d')}")

    if args.json:
        out = {
            "size_axis": axis,
            "database": version,
            "vendor": vendor_,
            "cores": cores,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "repeat": args.repeat,
            "commit_policy": policy,
            "load_average_at_start": load_start,
            "busy_cores_at_start": busy,
            "results": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def size_axis(sizes: list[int], args: argparse.Namespace) -> list[dict]:
    """Pairs/s of api, raw and (on small pools) old against the pool's size."""
    rows = []
    print(f"\npool-size axis: {', '.join(f'{n:,}' for n in sizes)} resources; {', '.join(map(str, SIZE_PROCS))}"
          f" processes; {args.seconds:g}s per run, median of {args.repeat}", flush=True)
    for size in sizes:
        pool = f"bench-size-{os.getpid()}-{size}"
        began = time.monotonic()
        Pool(pool).add_many(((f"r{i:07d}", None) for i in range(size)), batch_size=5000)
        print(f"  {size:,} resources made in {time.monotonic() - began:.1f}s", flush=True)
        try:
            for procs in SIZE_PROCS:
                modes = ["raw", "api"] + (["old"] if size <= OLD_MAX else [])
                samples: dict[str, list[float]] = {mode: [] for mode in modes}
                for i in range(args.repeat):
                    for mode in modes if i % 2 == 0 else modes[::-1]:
                        run = run_once(mode, pool, procs, 0.0, args.warmup, args.seconds)
                        samples[mode].append(run["pairs_per_s"])
                row = {"size": size, "procs": procs, **{mode: median(v) for mode, v in samples.items()}}
                rows.append(row)
                print(f"  {size:>9,} resources, {procs} process(es): "
                      + ", ".join(f"{mode} {row[mode]:,.0f}" for mode in modes) + " pairs/s", flush=True)
        finally:
            began = time.monotonic()
            deleted, _ = Resource.objects.filter(pool=pool).delete()
            print(f"  {deleted:,} rows deleted in {time.monotonic() - began:.1f}s", flush=True)
    print(f"\n{'resources':>10} | {'procs':>5} | {'api pairs/s':>11} | {'raw pairs/s':>11} | {'old pairs/s':>11} | "
          f"api vs smallest")
    for row in rows:
        first = next(r for r in rows if r["procs"] == row["procs"])
        old = f"{row['old']:>11,.0f}" if "old" in row else f"{'-':>11}"
        print(f"{row['size']:>10,} | {row['procs']:>5} | {row['api']:>11,.0f} | {row['raw']:>11,.0f} | {old} | "
              f"{first['api'] / row['api']:.2f}x the cost")
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Pairs/s against pool size, log-log, one line per mode and process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"api": "o-", "raw": "s--", "old": "x:"}
    for procs, colour in zip(SIZE_PROCS, ("tab:blue", "tab:orange")):
        for mode, style in styles.items():
            mine = [r for r in rows if r["procs"] == procs and mode in r]
            if mine:
                ax.plot([r["size"] for r in mine], [r[mode] for r in mine], style, color=colour,
                        label=f"{mode}, {procs} process{'es' * (procs > 1)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("resources in the pool")
    ax.set_ylabel("acquire+release pairs per second")
    ax.set_title(f"Acquire cost against pool size\n{title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
