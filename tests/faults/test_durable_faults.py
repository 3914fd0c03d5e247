"""Durable handlers through faults: 200 jobs that step, sleep, wait twice for an event and
once for one that never comes (until its timeout), run by worker processes behind the
fault proxy while it loses the replies to COMMITs (and to the lone statements that store
a step, begin a sleep or a wait, or time a wait out), then refuses every connection for a
few seconds, then loses replies again. The events are sent by the test through the proxy
too, so a sender loses replies as well.

A lost reply is the hard case: the server did the work, the client saw its connection
drop and runs the work again. Every job must end succeeded, each step stored once and
never replaced (every run of the handler saw the one stored result), each event stored
once although its sender retried, taken by exactly one wait, each wait given exactly its
own event; neither fault may cost an attempt, nor a worker its life. The handlers
(tests/faults/durable_handlers.py) log each run of a step's body and each result they got
back, so the check does not rest on the database it checks alone.

The two faults do not overlap: a unit of work retries a few times only (leases.db.run), and
an outage with lost replies on top can use those tries up; the handler's attempt then
fails and is retried, which is the design, not what this test is about.
"""
from __future__ import annotations

import signal
import time
from collections import Counter, defaultdict

import pytest
from django.db import connection

from leases.tasks import push_many
from leases.tasks.jobs.steps import send_event
from leases.tasks.models import Job, JobError, JobEvent, JobStep
from tests.faults.durable_handlers import LATE, PLACES, STEPS  # registers durable.flow and durable.aflow
from tests.faults.faultproxy import DropRule, FaultProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow,
              pytest.mark.usefixtures("fresh_queue_settings")]

COMMIT = r"^\s*COMMIT\b"
TOTAL = 200
HANDLERS = "tests.faults.durable_handlers"
#: The places of the two waits (from 1): the event k is taken by the k-th.
WAITS = tuple(seq for seq, name in enumerate(PLACES, 1) if name == "wait:go")
#: ... and that of the wait that times out.
LATE_SEQ = PLACES.index("wait:late") + 1
#: Replies the proxy loses, by what they answer: (pattern, probability, after).
LOST = {
    "commit": (COMMIT, 0.03, None),  # of claims, outcomes, suspensions...
    "take": (COMMIT, 0.3, r"SET taken_seq"),  # a wait took its event
    # An event sent: its job woken, and on PostgreSQL the workers listening for its queue.
    "send": (COMMIT, 0.3, r"SET run_at = .* AND waiting_for = |pg_notify\('leases_jobs'"),
    # A step's result, a sleep's or a wait's beginning, a wait's timeout: lone statements.
    "record": (r"^INSERT INTO \S*jobstep\W.*, TRUE, NULL,", 0.1, None),
    "begin": (r"^INSERT INTO \S*jobstep\W.*, NULL, FALSE,", 0.1, None),
    "timeout": (r"^UPDATE \S*jobstep\W.*timed_out", 0.2, None),
}


@pytest.fixture(autouse=True)
def a_server():
    if connection.vendor == "sqlite":
        pytest.skip("the fault-injection proxy stands in front of a server")


def lines(log) -> tuple[dict, dict]:
    """(tokens each step's body made, tokens the handler got back) by (n, step name)."""
    ran, saw = defaultdict(list), defaultdict(list)
    for line in log.read_text().splitlines():
        kind, n, name, _claims, token = line.split()
        (ran if kind == "ran" else saw)[int(n), name].append(token)
    return ran, saw


def lose_replies(proxy: FaultProxy, seed: int) -> dict[str, DropRule]:
    """Lose the replies of LOST from now on."""
    return {what: proxy.drop_reply(pattern, probability, seed=seed + i, after=after)
            for i, (what, (pattern, probability, after)) in enumerate(LOST.items())}


def send_the_events(proxied: str, numbers: dict[int, int], sent: Counter, last: int) -> None:
    """Send "go" number k (up to `last`) to each job suspended at its k-th wait (begun, not
    done) that has not had it; never to a job suspended at none, so a wait that lost the
    event it took would wait for good."""
    waiting = Job.objects.filter(status=Job.READY, waiting_for="event:go").values_list("id", flat=True)
    at = JobStep.objects.filter(job_id__in=list(waiting), seq__in=WAITS, done=False)
    for job_id, seq in sorted(at.values_list("job_id", "seq")):
        k = WAITS.index(seq) + 1
        if sent[job_id] < k <= last:
            assert sent[job_id] == k - 1, (job_id, sent[job_id], k)
            sent[job_id] = k
            try:
                send_event(job_id, "go", {"n": numbers[job_id], "k": k}, using=proxied)
            except ValueError as exc:  # it ended meanwhile: a wait took an event twice, or a copy
                events = list(JobEvent.objects.filter(job_id=job_id).values_list("data", "taken_seq"))
                pytest.fail(f"{exc}; its events: {events}")


def test_durable_jobs_ride_out_lost_replies_and_an_outage_with_each_step_and_event_once(
        proxied_workers, proxy, proxied, tmp_path):
    log = tmp_path / "runs.log"
    log.touch()
    push_many([("durable.aflow" if n % 2 else "durable.flow",
                {"n": n, "sleep": 0.2 + 0.2 * (n % 5), "log": str(log)}) for n in range(TOTAL)])
    numbers = {job_id: payload["n"] for job_id, payload in Job.objects.values_list("id", "payload")}
    assert len(numbers) == TOTAL
    rules = [lose_replies(proxy, 20)]
    # A quarter of the jobs have both their events before they run: kept, taken in order.
    sent = Counter()
    for job_id, n in numbers.items():
        if n % 4 == 0:
            for k in range(1, len(WAITS) + 1):
                send_event(job_id, "go", {"n": n, "k": k}, using=proxied)
                sent[job_id] = k
    # A ttl well past the outage plus a heartbeat's retries: no claim may lapse.
    procs = [proxied_workers.start("--concurrency", "4", "--ttl", "15", "--import", HANDLERS)
             for _ in range(3)]

    deadline, outage, again = time.monotonic() + 90, None, None
    while (done := Job.objects.filter(status=Job.SUCCEEDED).count()) < TOTAL:
        dead = [proxied_workers.stderr(proc) for proc in procs if proc.poll() is not None]
        assert not dead, dead
        if outage is None and JobEvent.objects.exclude(taken_seq=None).count() >= TOTAL * len(WAITS) // 3:
            # Every connection cut and none taken for 2 s (the sender's too): within what
            # db.run waits out (at least 3.5 s of pauses, refusals being instant) with room for
            # the proxy, a thread of this busy process, to end it late, so nothing but retries
            # follows (CI once saw a 3 s outage outlast a step's retries).
            # No reply is lost meanwhile, nor until every retry begun in it is over (7 s at
            # most), lest an outage and lost replies together use up one unit's tries.
            proxy.clear()
            proxy.refuse(2)
            outage, again = done, time.monotonic() + 8
        if again is not None and time.monotonic() > again:
            rules.append(lose_replies(proxy, 40))
            again = None
        # The second events wait for the replies to be lost again, so the second half of
        # each job's run (its second wait, the wait that times out, its last step) meets them.
        send_the_events(proxied, numbers, sent, len(WAITS) if len(rules) == 2 else 1)
        if time.monotonic() > deadline:
            stuck = list(Job.objects.exclude(status=Job.SUCCEEDED).values_list("id", "waiting_for")[:10])
            pytest.fail(f"{done} of {TOTAL} succeeded; stuck: {stuck}; their events sent: "
                        f"{[sent[job_id] for job_id, *_ in stuck]} (one suspended for 'go' past the"
                        " wait that took its event lost it)")
        time.sleep(0.05)
    for proc in procs:
        assert proc.poll() is None, proxied_workers.stderr(proc)
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proxied_workers.wait(proc, 60) == 0, proxied_workers.stderr(proc)
        assert "Traceback" not in proxied_workers.stderr(proc), proxied_workers.stderr(proc)

    # The faults happened, on each path, and the outage came mid-run and reached the workers.
    assert outage is not None and outage < TOTAL, outage
    lost = Counter()
    for phase in rules:
        lost.update({what: rule.dropped for what, rule in phase.items()})
    assert len(rules) == 2 and min(lost.values()) >= 3, (lost, len(rules))  # each kind, before and after
    assert all(sum(rule.dropped for rule in phase.values()) >= 10 for phase in rules)  # the outage
    assert any("unreachable" in proxied_workers.stderr(proc) for proc in procs)

    # No attempt was lost: none failed, none was recovered (both would use a try).
    failed = list(JobError.objects.values_list("job_id", "exception", "message", "traceback")[:3])
    assert not failed, "attempts failed:\n" + "\n".join(f"job #{job_id}: {exc}: {message}\n{trace}"
                                                      for job_id, exc, message, trace in failed)
    assert set(Job.objects.values_list("attempt", flat=True)) == {1}

    # Every event stored once although its sender retried, taken once, by its own wait.
    events = list(JobEvent.objects.values_list("job_id", "data", "taken_seq"))
    assert len(events) == TOTAL * len(WAITS), Counter(job_id for job_id, *_ in events).most_common(3)
    assert Counter((job_id, seq) for job_id, _, seq in events) == {
        (job_id, seq): 1 for job_id in numbers for seq in WAITS}
    assert all(data == {"n": numbers[job_id], "k": WAITS.index(seq) + 1} for job_id, data, seq in events)

    # Each job's places stored once, in order; each wait holds its own event's data; the
    # handler's last run got each step's stored result and each wait's event.
    stored = defaultdict(dict)
    for job_id, seq, name, result, done_ in JobStep.objects.values_list("job_id", "seq", "name", "result",
                                                                        "done"):
        assert done_ or name == "sleep", (job_id, seq, name)  # a sleep stays begun, its end past
        stored[job_id][seq] = (name, result)
    for job_id, result in Job.objects.values_list("id", "result"):
        n = numbers[job_id]
        assert [name for _, (name, _) in sorted(stored[job_id].items())] == list(PLACES), job_id
        for k, seq in enumerate(WAITS, 1):
            assert stored[job_id][seq][1] == {"data": {"n": n, "k": k}}
        assert stored[job_id][LATE_SEQ][1] == {"timed_out": True}
        assert result["events"] == [{"n": n, "k": 1}, {"n": n, "k": 2}, LATE], result
        steps = {name: value for name, value in stored[job_id].values() if name in STEPS}
        assert result["steps"] == steps, (job_id, result, steps)

    # By the handlers' own log: each step's body ran once, and every run of the handler
    # (one per sleep and wait, and again after each) got back the result that body made.
    ran, saw = lines(log)
    assert len(ran) == len(saw) == TOTAL * len(STEPS)
    for job_id, result in Job.objects.values_list("id", "result"):
        n = numbers[job_id]
        for name, token in result["steps"].items():
            assert ran[n, name] == [token], (n, name, ran[n, name])
            assert set(saw[n, name]) == {token}, (n, name, saw[n, name])
