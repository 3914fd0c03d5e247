"""Why jobs that need a resource wait, as operators read it: `jobs stats` per pool and
target (usable slots, why the others are not, when the next comes back), `jobs show` (the
bans and rests its attempts gave, how its pool stands for it), and a worker's log line,
which names the real reason and only when no slot could start the jobs."""
from __future__ import annotations

import io
import logging
import subprocess

import pytest
from django.core.management import call_command

import tests.tasks.test_leased_jobs  # noqa: F401 - registers lease.fetch (target: the site), lease.eu (where=)
from leases import Pool, targets
from leases.tasks import push
from tests.tasks.test_leased_jobs import drain, worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def out(*args: str) -> str:
    buffer = io.StringIO()
    call_command(*args, stdout=buffer)
    return buffer.getvalue()


def section(text: str, title: str) -> list[list[str]]:
    """The table under `title` in a command's output, as lists of words."""
    lines = text.splitlines()
    found = []
    for line in lines[lines.index(title) + 1:]:
        if "  " not in line:  # a table's columns are two spaces apart at least
            break
        found.append(line.split())
    return found


@pytest.fixture
def stuck():
    """Of p1..p3: p2 quarantined, one held by a running job of b.example, the other banned
    for a.example (its name returned)."""
    Pool("proxies").add_many([("p1", None), ("p2", None), ("p3", None)])
    Pool("proxies").quarantine("p2", seconds=3600, reason="dead")
    push("lease.fetch", {"n": 0, "site": "b.example"})
    w = worker(concurrency=1)
    (job,) = w.claim(1)
    banned = "p1" if job.lease.name == "p3" else "p3"
    targets.ban("proxies", banned, "a.example", 600, "403 at a")
    yield banned
    w.hand_back()


def test_jobs_stats_says_per_pool_and_target_how_many_could_start_and_why_not(stuck):
    push("lease.fetch", {"n": 1, "site": "a.example"})
    push("lease.fetch", {"n": 2, "site": "a.example"})
    push("lease.fetch", {"n": 3, "site": "b.example"})
    push("lease.eu", {"n": 4})
    table = section(out("jobs", "stats"), "due jobs that need a resource:")
    assert table[0] == ["POOL", "TARGET", "WHERE", "DUE", "USABLE", "NOT", "USABLE", "NEXT", "USABLE"]
    a, eu, b = table[1:]  # most due jobs first, then by pool and target
    assert a == ["proxies", "a.example", "-", "2", "0/3", "1", "quarantined,", "1", "held,", "1", "banned", "in",
                 "9m", "(a", "ban", "of", stuck, "ends)"]
    assert b == ["proxies", "b.example", "-", "1", "1/3", "1", "quarantined,", "1", "held", "now"]
    assert eu[:4] == ["proxies", "-", '{"region":', '"eu"}'] and eu[4:6] == ["1", "0/3"]
    assert "1 not matching the handler's where=" in " ".join(eu)


def test_jobs_stats_as_a_process(stuck, manage, child_env):
    """Through manage.py, which does not import the tests' handlers: no where= is known there."""
    push("lease.fetch", {"n": 1, "site": "a.example"})
    done = subprocess.run([*manage, "jobs", "stats"], env=child_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert section(done.stdout, "due jobs that need a resource:")[1][:5] == ["proxies", "a.example", "1", "0/3", "1"]


def test_jobs_show_lists_the_bans_its_attempts_gave_and_how_its_pool_stands_for_it():
    Pool("proxies").add_many([("p1", None), ("p2", None)])
    job = push("lease.fetch", {"n": 1, "site": "a.example", "ban": True})
    drain()  # each attempt bans the resource it got: p1 and p2, then none is left for a.example
    shown = out("jobs", "show", str(job.pk))
    head = dict(line.split(None, 1) for line in shown.splitlines() if line.startswith(("claims", "resources")))
    assert head["claims"].strip() == "2"
    assert head["resources"].startswith("0 of 2 resources usable for a.example: 2 banned; the next in ")
    met = section(shown, "bans and rests its attempts met (2):")
    assert met[0] == ["AT", "RESOURCE", "TARGET", "VERDICT", "UNTIL", "REASON"]
    assert sorted(line[2] for line in met[1:]) == ["proxies/p1", "proxies/p2"]
    assert all(line[3:5] == ["a.example", "banned"] and line[-2:] == ["403", "here"] for line in met[1:])
    assert len(met) == 3


def test_a_workers_line_names_the_real_reason_and_only_when_no_slot_could_start(caplog):
    Pool("proxies").add_many([("p1", None), ("p2", None), ("p3", None)])
    targets.ban("proxies", "p1", "a.example", 600, "403 at a")
    for n in range(3):
        push("lease.fetch", {"n": n, "site": "a.example"})
    caplog.set_level(logging.INFO, logger="leases.tasks.worker")
    busy = worker(concurrency=3)
    assert len(busy.claim(3)) == 2  # p2 and p3; the third job is passed over
    busy.hand_back()  # both free again: the third job could start now
    busy.recover()
    assert "wait for a resource" not in caplog.text  # nothing is stuck: no line
    targets.ban("proxies", "p2", "a.example", 60, "429 at a")
    targets.ban("proxies", "p3", "a.example", 30, "429 at a")
    told = worker()
    told.recover()
    lines = [r.getMessage() for r in caplog.records if "wait for a resource" in r.getMessage()]
    assert len(lines) == 1
    told.recover()  # the look is once a period, not at every recovery
    assert len([r for r in caplog.records if "wait for a resource" in r.getMessage()]) == 1
    assert (": 3 job(s) of pool proxies wait for a resource: 0 of 3 resources usable for a.example: 3 banned;"
            " the next in ") in lines[0]
    assert lines[0].endswith("(a ban of p3 ends)")


def test_a_worker_looks_for_stuck_jobs_once_a_period_even_when_none_are(monkeypatch):
    """The look reads every due job of the worker's pools: each recovery (5 s) made it when
    nothing was stuck, a cost that grew with the backlog for nothing."""
    from leases.tasks.jobs import waits
    from leases.tasks.worker import duties

    Pool("proxies").add("p1")
    push("lease.fetch", {"n": 1, "site": "a.example"})
    looks, real = [], waits.waiting
    monkeypatch.setattr(waits, "waiting", lambda *a, **kw: looks.append(1) or real(*a, **kw))
    w = worker()
    w.recover()
    w.recover()
    assert len(looks) == 1
    w._next_wait_look -= duties.LIMIT_LOG_EVERY  # the period has passed
    w.recover()
    assert len(looks) == 2
