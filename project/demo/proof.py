"""The exclusivity proof: from the crawlers' own reports, no proxy had two holders at once.

Pure (no Django, no processes), so that tests can feed it made-up uses.

How a use is reported, so that the check means something: before each step a crawler
reads its current lease and calls `lease.check()`; it times the step with
`time.monotonic()` (one clock for every process of the machine) and reports the window
[start, end] only if `lease.remaining() > 0` after the step, which proves the database
held the lease for it throughout the window (the engine's local deadline is never later
than the server's expiry, to within the server clock's resolution: 1 ms on SQLite).
That proof covers expiry only: an operator's `Pool.release()`, `quarantine()` or
`remove()` frees a row at once, and its holder only learns so at its next renewal (the
fencing token is what protects against that), so the demo does none of them while the
crawlers run; it frees leftovers of an earlier run before it starts them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

#: (proxy, token, crawler, pid) -> [first start, last end] of that holder's uses of that lease
HolderSpans = dict[tuple[str, int, int, int], list[float]]
#: (proxy, token) -> [first start, last end] of all uses of that lease
TokenSpans = dict[tuple[str, int], list[float]]


@dataclass(frozen=True)
class Use:
    """One step of a crawler's work through a proxy, held by it from `start` to `end`."""

    crawler: int
    pid: int
    proxy: str
    token: int
    start: float  # time.monotonic(): system-wide, so comparable between processes
    end: float


@dataclass
class Verdict:
    """What `check_exclusivity` found: `ok` when it found no problem."""

    ok: bool
    problems: list[str]
    uses: int
    leases: int  # distinct (proxy, token) pairs
    proxies: int
    max_simultaneous: int  # most holders of one proxy at one instant


def check_exclusivity(uses: Iterable[Use], limit: int = 20) -> Verdict:
    """Check that no proxy was ever used by two holders at once, from reported uses.

    - every (proxy, token) pair was reported by one crawler process only;
    - the tokens of a proxy follow each other in time: all uses of a token end before
      the first use of the next higher token begins (so no two tokens overlap);
    - sweeping over every (proxy, token, crawler) span, at most one is active at once.
    """
    uses = list(uses)
    spans = _holder_spans(uses)
    by_token = _token_spans(spans)
    problems = _backward_windows(uses) + _shared_tokens(spans) + _overlapping_tokens(by_token)
    most = _most_simultaneous(spans)
    if most > 1:
        problems.append(f"max simultaneous holders of one proxy = {most}")
    if not uses:
        problems.append("no use was reported: nothing was checked")
    if len(problems) > limit:
        problems[limit:] = [f"... and {len(problems) - limit} more problems"]
    return Verdict(
        ok=not problems,
        problems=problems,
        uses=len(uses),
        leases=len(by_token),
        proxies=len({proxy for proxy, _ in by_token}),
        max_simultaneous=most,
    )


def _holder_spans(uses: list[Use]) -> HolderSpans:
    """Each holder's uses of a lease as one span: a holder keeps its lease between steps."""
    spans: HolderSpans = {}
    for u in uses:
        span = spans.setdefault((u.proxy, u.token, u.crawler, u.pid), [u.start, u.end])
        span[0], span[1] = min(span[0], u.start), max(span[1], u.end)
    return spans


def _token_spans(spans: HolderSpans) -> TokenSpans:
    """Each lease's span over all its holders (one, if the check passes)."""
    by_token: TokenSpans = {}
    for (proxy, token, _, _), (start, end) in spans.items():
        span = by_token.setdefault((proxy, token), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)
    return by_token


def _backward_windows(uses: list[Use]) -> list[str]:
    """Windows that end before they start: a broken report proves nothing."""
    return [
        f"{u.proxy} token {u.token}: crawler {u.crawler} reported a window that ends before it starts"
        for u in uses
        if u.end < u.start
    ]


def _shared_tokens(spans: HolderSpans) -> list[str]:
    """Leases reported by more than one crawler process, even at different times."""
    who: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for proxy, token, crawler, pid in spans:
        who[(proxy, token)].append((crawler, pid))
    problems = []
    for (proxy, token), holders in sorted(who.items()):
        if len(holders) > 1:
            names = ", ".join(f"crawler {c} (pid {p})" for c, p in sorted(holders))
            problems.append(f"{proxy} token {token} was used by {len(holders)} holders: {names}")
    return problems


def _overlapping_tokens(by_token: TokenSpans) -> list[str]:
    """A proxy's tokens out of time order: a higher token in use before a lower one stopped."""
    per_proxy: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for (proxy, token), (start, end) in by_token.items():
        per_proxy[proxy].append((token, start, end))
    problems = []
    for proxy, tokens in sorted(per_proxy.items()):
        tokens.sort()
        for (t1, _, end1), (t2, start2, _) in zip(tokens, tokens[1:]):
            if start2 <= end1:
                problems.append(
                    f"{proxy}: token {t2} was in use {end1 - start2:.3f}s "
                    f"before token {t1} stopped being used"
                )
    return problems


def _most_simultaneous(spans: HolderSpans) -> int:
    """The most holders' spans active at one instant on one proxy, by a sweep over their ends."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for (proxy, _, _, _), (start, end) in spans.items():
        events[proxy] += [(start, 0), (end, 1)]  # a start sorts before an end at the same instant
    most = 0
    for evs in events.values():
        active = 0
        for _, kind in sorted(evs):
            active += 1 if kind == 0 else -1
            most = max(most, active)
    return most
