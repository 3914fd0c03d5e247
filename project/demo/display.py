"""What the demo shows: the live table on a terminal, status lines otherwise, and the summary.

The table gives every proxy's holder, fencing token and seconds to expiry by the
database clock; the summary ends with the verdict line, OK or FAILED.
"""

from __future__ import annotations

import math
import shutil
import textwrap
import time
from typing import Any

from .crawler import crawler_of
from .kills import Kill, recovery_problems
from .proof import Verdict, check_exclusivity
from .scoreboard import Scoreboard

GREEN, RED, DIM, RESET = "\x1b[32m", "\x1b[31m", "\x1b[2m", "\x1b[0m"
CELL = 39  # one proxy in the table (37 characters) and the gap after it
LEGEND = "killed-N: held by a SIGKILLed crawler; nobody renews it, the database frees it at 0.0s"


def counts(board: Scoreboard) -> tuple[dict[str, int], dict[str, int]]:
    """Proxies by state at the last poll, and crawlers by what they do."""
    proxies = {"held": 0, "free": 0, "quarantined": 0}
    for r in board.rows:
        proxies[r.state_at(board.now_db)] += 1
    crawlers = {"running": 0, "waiting": 0, "idle": 0, "killed": 0}
    for c in board.crawlers.values():
        key = {"starting": "waiting", "exited": "idle", "failed": "idle"}.get(c.state, c.state)
        crawlers[key] += 1
    return proxies, crawlers


def status(board: Scoreboard) -> str:
    """One status line, for output that is not a terminal."""
    p, c = counts(board)
    return (
        f"proxies {p['held']} held, {p['free']} free, {p['quarantined']} quarantined | "
        f"crawlers {c['running']} running, {c['waiting']} waiting, {c['idle']} between jobs, "
        f"{c['killed']} killed | {len(board.granted)} leases granted, {len(board.uses)} uses"
    )


# -- the live table ---------------------------------------------------------------------------


def frame(board: Scoreboard) -> str:
    """One screen: 3 header lines, the table, then the legend and events if room is left."""
    width, height = shutil.get_terminal_size((100, 40))
    head = _head(board)
    table = _table(board, width, height, len(head))
    lines = [h[:width] for h in head]
    spare = height - len(lines) - len(table)
    if spare >= 1:
        lines.append("")
        spare -= 1
    lines += table
    if spare >= 2:
        lines += ["", LEGEND[:width]]
        spare -= 2
    if spare > 0:
        wrapped = [
            w for e in board.events[-spare:] for w in textwrap.wrap(e, width, subsequent_indent=" " * 9)
        ]
        lines += wrapped[-spare:]
    return "\x1b[H" + "\n".join(line + "\x1b[K" for line in lines) + "\x1b[J"


def _head(board: Scoreboard) -> list[str]:
    opts = board.opts
    p, c = counts(board)
    elapsed = time.monotonic() - board.start
    clock = f"{board.now_db:%H:%M:%S.%f}"[:-3]
    return [
        f"django-leases demo {elapsed:5.1f}s of {opts.seconds:g}s   database clock {clock} UTC   "
        f"ttl {opts.ttl:g}s, renewal every {opts.interval:.2g}s   {board.where}",
        f"proxies   {p['held']:3} held  {p['free']:3} free  {p['quarantined']:3} quarantined      "
        f"{len(board.granted)} leases granted, {len(board.uses)} uses",
        f"crawlers  {c['running']:3} running  {c['waiting']:3} waiting  {c['idle']:3} between jobs  "
        f"{c['killed']:3} killed",
    ]


def _table(board: Scoreboard, width: int, height: int, top: int) -> list[str]:
    """The proxies in columns, below `top` header lines; cut short if the screen is too small."""
    n = len(board.rows)
    ncols = _columns(n, width, height, top)
    nrows = math.ceil(n / ncols) if n else 0
    room = height - top - 1
    shown = nrows if nrows <= room else max(0, room - 1)
    table = ["  ".join([f"{'proxy':<10}{'holder':<13}{'token':<6}{'expires':>8}"] * min(ncols, max(n, 1)))]
    for i in range(shown):
        parts = []
        for j in range(ncols):
            k = j * nrows + i
            if k < n:
                text, colour = _cell(board, board.rows[k])
                parts.append(f"{colour}{text}{RESET}" if colour else text)
        table.append("  ".join(parts))
    if shown < nrows:
        table.append(f"... {n - shown * ncols} more proxies: enlarge the terminal")
    return table


def _columns(n: int, width: int, height: int, top: int) -> int:
    """The fewest columns that leave room for the legend and events; as many as fit otherwise."""
    most = max(1, (width + 2) // CELL)
    for cols in range(1, most + 1):
        if top + 1 + math.ceil(n / cols) + 5 <= height:
            return cols
    return most


def _cell(board: Scoreboard, row: Any) -> tuple[str, str]:
    """One proxy: (plain text, colour)."""
    from leases.models import Resource

    state = row.state_at(board.now_db)
    if state == Resource.FREE:
        return f"{row.name:<10}{'free':<13}#{row.token:<5}{'':>8}", GREEN
    if state == Resource.QUARANTINED:
        return f"{row.name:<10}{'quarantined':<13}#{row.token:<5}{'':>8}", DIM
    who, colour = row.holder.split(":")[0][:12], ""
    cid = crawler_of(row.holder)
    if cid in board.crawlers and board.crawlers[cid].state == "killed":
        who, colour = f"killed-{cid}", RED
    left = (row.busy_before - board.now_db).total_seconds()
    return f"{row.name:<10}{who:<13}#{row.token:<5}{left:7.1f}s", colour


# -- the summary ---------------------------------------------------------------------------------


def summary(board: Scoreboard, elapsed: float, interrupted: BaseException | None) -> bool:
    """Print what happened and the verdict; True if it is OK.

    An interrupted run is never OK, and only its exclusivity check is complete.
    """
    verdict = check_exclusivity(board.uses)
    holding = [k for k in board.kills if k.proxy is not None]
    print()
    print("summary")
    _say_activity(board, elapsed, verdict)
    _say_kills(board, holding)
    _say_exclusivity(verdict)
    p, _ = counts(board)
    _say("after shutdown", f"{p['free']} free, {p['held']} held, {p['quarantined']} quarantined")
    if interrupted is not None:
        for problem in verdict.problems:
            _say("problem", problem)
        why = str(interrupted) or "Ctrl-C"
        print(f"verdict: interrupted ({why}) after {elapsed:.1f}s; every crawler stopped")
        return False
    failures = verdict.problems + recovery_problems(holding, board.opts) + _crawler_problems(board)
    for problem in failures:
        _say("problem", problem)
    ok = not failures
    print(f"verdict: {'OK' if ok else 'FAILED'}", flush=True)
    return ok


def _say(label: str, text: str) -> None:
    print(f"  {label:<16}{text}")


def _say_activity(board: Scoreboard, elapsed: float, verdict: Verdict) -> None:
    opts = board.opts
    tokens = sum(r.token for r in board.rows) - board.tokens_at_start
    _say(
        "run",
        f"{elapsed:.1f}s, {opts.proxies} proxies, {opts.crawlers} crawlers, ttl {opts.ttl:g}s, "
        f"renewal every {opts.interval:.2g}s, {board.where}",
    )
    _say(
        "acquisitions",
        f"{len(board.granted)} reported by crawlers, fencing tokens grew by {tokens}; "
        f"{board.lost} lost to late renewals",
    )
    _say(
        "uses",
        f"{verdict.uses} confirmed steps; {board.late} not counted "
        "(lease gone by the step's end, mostly at shutdown)",
    )


def _say_kills(board: Scoreboard, holding: list[Kill]) -> None:
    recovered = [k for k in holding if k.freed_after is not None]
    _say("kills", f"{len(board.kills)} crawler(s) SIGKILLed, {len(holding)} of them holding a proxy")
    _say("recovered", f"{len(recovered)}/{len(holding)} proxies of killed crawlers came back after the ttl")
    if holding:
        print(
            f"    {'proxy':<10}{'token':<7}{'crawler':<12}"
            f"{'killed at':>10}{'free again':>12}{'retaken':>10}   by"
        )
    for k in holding:
        print(f"    {k.row()}")


def _say_exclusivity(verdict: Verdict) -> None:
    _say(
        "exclusivity",
        f"{'OK' if verdict.ok else 'FAILED'}: {verdict.uses} uses of {verdict.leases} "
        f"(proxy, token) leases on {verdict.proxies} proxies",
    )
    _say(
        "",
        "each lease used by one crawler, tokens in time order, "
        f"max simultaneous holders per proxy = {verdict.max_simultaneous}",
    )


def _crawler_problems(board: Scoreboard) -> list[str]:
    """Crawlers that failed, or exited badly without being killed."""
    problems = []
    for c in board.crawlers.values():
        if c.error:
            problems.append(f"crawler {c.cid}: {c.error.strip().splitlines()[-1]}")
        elif c.state != "killed" and c.process.exitcode not in (0, None):
            problems.append(f"crawler {c.cid} exited with code {c.process.exitcode}")
    return problems
