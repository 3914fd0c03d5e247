"""The demo (`make demo`) in a small, fast version, and the exclusivity check it relies on."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from project.demo import Use, check_exclusivity
from tests.conftest import ROOT


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_demo_recovers_a_killed_crawlers_proxy_and_checks_exclusivity(child_env):
    args = ["--proxies", "4", "--crawlers", "6", "--kills", "1", "--seconds", "8", "--ttl", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "project.demo", *args],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"crawler \d+ SIGKILLed holding proxy-\d+ \(token \d+\)", out)
    assert re.search(r"recovered\s+1/1 proxies of killed crawlers came back", out)
    # The kill's row: proxy, token, crawler, killed at, free again after, retaken after, by.
    row = re.search(r"proxy-\d+\s+#\d+\s+crawler \d+\s+[\d.]+s\s+([\d.]+)s\s+([\d.]+|-)s?\s", out)
    assert row, out
    assert float(row.group(1)) <= 2.0 + 0.5  # within the ttl of the kill
    assert re.search(r"exclusivity\s+OK: [1-9]\d* uses", out)
    assert "max simultaneous holders per proxy = 1" in out
    assert "after shutdown  4 free, 0 held" in out
    assert out.rstrip().endswith("verdict: OK")


def use(crawler, proxy, token, start, end, pid=None):
    return Use(crawler, pid if pid is not None else 1000 + crawler, proxy, token, start, end)


GOOD = [
    use(1, "proxy-01", 1, 0.0, 0.2),
    use(1, "proxy-01", 1, 0.3, 0.5),
    use(2, "proxy-01", 2, 0.6, 0.8),  # after token 1's last use
    use(3, "proxy-02", 5, 0.1, 0.9),  # another proxy at the same time
    use(2, "proxy-01", 3, 0.85, 1.0),  # the same crawler may get the proxy again
]


def test_the_check_accepts_one_holder_at_a_time():
    verdict = check_exclusivity(GOOD)
    assert verdict.ok, verdict.problems
    assert (verdict.uses, verdict.leases, verdict.proxies, verdict.max_simultaneous) == (5, 4, 2, 1)


def test_the_check_rejects_overlapping_tokens():
    verdict = check_exclusivity(GOOD + [use(4, "proxy-02", 6, 0.8, 1.1)])  # token 5 still in use
    assert not verdict.ok
    assert verdict.max_simultaneous == 2
    assert any("proxy-02: token 6 was in use" in p for p in verdict.problems)


def test_the_check_rejects_a_token_used_by_two_crawlers_even_at_different_times():
    verdict = check_exclusivity(GOOD + [use(9, "proxy-02", 5, 2.0, 2.1)])
    assert not verdict.ok
    assert any("proxy-02 token 5 was used by 2 holders" in p for p in verdict.problems)


def test_the_check_rejects_the_same_crawler_id_from_another_process():
    verdict = check_exclusivity(GOOD + [use(3, "proxy-02", 5, 0.95, 1.0, pid=99)])
    assert not verdict.ok
    assert any("pid 99" in p for p in verdict.problems)


def test_the_check_rejects_tokens_out_of_time_order():
    # Token 8 used, then token 7 afterwards: no overlap, but the older lease came later.
    bad = [use(1, "proxy-03", 8, 0.0, 0.2), use(2, "proxy-03", 7, 0.5, 0.6)]
    verdict = check_exclusivity(bad)
    assert not verdict.ok
    assert verdict.max_simultaneous == 1
    assert any("proxy-03: token 8" in p for p in verdict.problems)


def test_the_check_rejects_a_window_that_ends_before_it_starts_and_an_empty_report():
    assert not check_exclusivity([use(1, "proxy-01", 1, 0.5, 0.4)]).ok
    empty = check_exclusivity([])
    assert not empty.ok and "nothing was checked" in empty.problems[0]
