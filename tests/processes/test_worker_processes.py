"""The job queue worker as real `manage.py leases_worker` processes: many workers on one
queue, SIGKILL, SIGTERM (graceful and twice), SIGSTOP past the ttl, bounded queues whose
pushers wait on workers, and the command's refusal of bad input.

Workers write "n pid" lines to a log file from their handlers, so a test counts runs per
process without trusting the database it is checking.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import Counter

import pytest

import tests.jobs  # noqa: F401 - registers noop, sleepy, echo
import tests.jobs_proc  # noqa: F401 - registers nap
from leases.exceptions import QueueFull
from leases.tasks import push, push_many
from leases.tasks import queue as jobqueue
from leases.tasks.jobs import push as jobpush
from leases.tasks.models import Job, JobError, Queue
from leases.tasks.models import Worker as WorkerRow
from tests.conftest import wait_for
from tests.helpers import log_lines

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED = range(6)
LOST = "leases.exceptions.WorkerLost"


def of(proc: subprocess.Popen):
    """Jobs whose `worker` is this process (worker names are host:pid:random)."""
    return Job.objects.filter(worker__contains=f":{proc.pid}:")


def running_in(proc: subprocess.Popen, count: int, timeout: float = 30) -> list[int]:
    """Wait until `proc` runs `count` jobs; their ids."""
    wait_for(lambda: of(proc).filter(status=RUNNING).count() == count, timeout, f"{count} jobs running in {proc.pid}")
    return sorted(of(proc).filter(status=RUNNING).values_list("pk", flat=True))





def states(ids) -> dict[int, tuple]:
    rows = Job.objects.filter(pk__in=ids).values_list("pk", "status", "attempt", "worker", "result", "finished_at")
    return {row[0]: row[1:] for row in rows}


# -- many workers -------------------------------------------------------------------------


def test_three_workers_run_every_job_exactly_once(workers, tmp_path):
    log = tmp_path / "runs.log"
    assert push_many([("noop", {"n": n, "log": str(log)}) for n in range(2000)]) == 2000
    procs = [workers.start("--burst", "--queue", "default", "--concurrency", "4") for _ in range(3)]
    for proc in procs:
        assert workers.wait(proc) == 0, workers.stderr(proc)

    runs = log_lines(log)
    counts = Counter(n for n, _ in runs)
    assert len(runs) == 2000 and set(counts) == set(range(2000)) and set(counts.values()) == {1}
    assert Job.objects.filter(status=SUCCEEDED, attempt=1).count() == 2000
    assert not Job.objects.exclude(status=SUCCEEDED).exists()
    assert not JobError.objects.exists()
    pids = {pid for _, pid in runs}
    assert pids <= {proc.pid for proc in procs}
    assert len(pids) > 1, "one worker did all the work: the claim was not shared"
    # Burst workers give their rows up on the way out.
    assert WorkerRow.objects.count() == 3 and set(WorkerRow.objects.values_list("holder", flat=True)) == {""}


# -- SIGKILL --------------------------------------------------------------------------------


def test_a_worker_whose_claim_was_full_claims_again_without_waiting_for_a_poll(workers):
    """A drain pushes nothing, so no notification comes. Whenever a turn found its
    threads busy and they all finished within it, the loop waited for its poll (here the
    scheduler's next pass, half a second) with nothing running and thousands due: 20,000
    jobs took 38 s. Going on at once after a full claim, they take about 6."""
    push_many([("noop", {"n": n}) for n in range(20000)])
    began = time.monotonic()
    procs = [workers.start("--burst", "--concurrency", "16", "--poll", "5") for _ in range(2)]
    for proc in procs:
        assert workers.wait(proc, 120) == 0, workers.stderr(proc)
    assert Job.objects.filter(status=SUCCEEDED).count() == 20000
    assert time.monotonic() - began < 20


def test_jobs_of_a_sigkilled_worker_are_recovered_and_run_elsewhere(workers, tmp_path):
    log = tmp_path / "runs.log"
    # Claimed first (highest priority): its only attempt is lost with the worker.
    doomed = push("nap", {"n": 99, "seconds": 30, "log": str(log)}, priority=10, max_attempts=1)
    push_many([("nap", {"n": n, "seconds": 30, "log": str(log)}) for n in range(6)])
    killed = workers.start("--queue", "default", "--concurrency", "4", "--ttl", "1.5")
    taken = running_in(killed, 4)
    assert doomed.pk in taken
    os.kill(killed.pid, signal.SIGKILL)
    assert workers.wait(killed) == -signal.SIGKILL
    name = of(killed).first().worker

    # A live worker of another queue recovers them but runs none, so "back to ready" holds still.
    recoverer = workers.start("--queue", "other", "--ttl", "1.5")
    wait_for(lambda: not Job.objects.filter(status=RUNNING).exists(), 30, "recovery of the killed worker's jobs")
    back = [pk for pk in taken if pk != doomed.pk]
    for pk, (status, attempt, worker, result, finished_at) in states(back).items():
        assert (status, attempt, worker, finished_at) == (READY, 1, "", None), pk
    row = Job.objects.get(pk=doomed.pk)
    assert (row.status, row.attempt, row.worker) == (DEAD, 1, "") and row.finished_at is not None
    errors = list(JobError.objects.order_by("job_id").values_list("job_id", "attempt", "exception", "message", "worker"))
    assert [e[:3] for e in errors] == [(pk, 1, LOST) for pk in taken]
    # The error names the lost worker, and its message the worker that recovered the job.
    assert all(e[4] == name and f":{recoverer.pid}:" in e[3] for e in errors)

    # With the long naps cut short, a worker of the queue finishes everything but the dead job.
    finisher = workers.start("--burst", "--queue", "default", "--concurrency", "8", JOBS_PROC_NAP="0.1")
    assert workers.wait(finisher) == 0, workers.stderr(finisher)
    os.kill(recoverer.pid, signal.SIGTERM)
    assert workers.wait(recoverer) == 0, workers.stderr(recoverer)

    assert not Job.objects.filter(status__in=[READY, RUNNING]).exists()
    assert Job.objects.filter(status=SUCCEEDED).count() == 6
    assert set(Job.objects.filter(pk__in=back).values_list("attempt", flat=True)) == {2}
    assert set(Job.objects.filter(status=SUCCEEDED).exclude(pk__in=back).values_list("attempt", flat=True)) == {1}
    assert JobError.objects.count() == len(taken)  # nothing but the lost attempts
    runs = log_lines(log)
    assert sorted(n for n, _ in runs) == list(range(6))  # the killed attempts never logged
    assert {pid for _, pid in runs} == {finisher.pid}


# -- SIGTERM --------------------------------------------------------------------------------


def test_sigterm_lets_short_jobs_finish_and_claims_no_more(workers, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("nap", {"n": n, "seconds": 1.5, "log": str(log)}) for n in range(8)])
    proc = workers.start("--queue", "default", "--concurrency", "4", "--grace", "20")
    taken = running_in(proc, 4)
    os.kill(proc.pid, signal.SIGTERM)
    assert workers.wait(proc, 30) == 0, workers.stderr(proc)

    for pk, (status, attempt, worker, result, _) in states(taken).items():
        assert (status, attempt, result) == (SUCCEEDED, 1, {"pid": proc.pid}), pk
    rest = Job.objects.exclude(pk__in=taken)
    assert rest.count() == 4 and set(rest.values_list("status", "attempt", "worker")) == {(READY, 0, "")}
    assert sorted(pid for _, pid in log_lines(log)) == [proc.pid] * 4
    assert not JobError.objects.exists()


def test_sigterm_hands_jobs_longer_than_the_grace_back_to_the_queue(workers, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("nap", {"n": n, "log": str(log)}) for n in range(2)])
    proc = workers.start("--queue", "default", "--concurrency", "2", "--grace", "0.5", JOBS_PROC_NAP="60")
    taken = running_in(proc, 2)
    os.kill(proc.pid, signal.SIGTERM)
    assert workers.wait(proc, 30) == 0, workers.stderr(proc)

    rows = Job.objects.filter(pk__in=taken)
    # The interrupted try is given back; the handler's maximum stays as it set it.
    assert set(rows.values_list("status", "worker", "attempt", "max_attempts", "claims")) == {(READY, "", 0, 3, 1)}
    assert not rows.filter(expires_at__isnull=False).exists()
    assert log_lines(log) == [] and not JobError.objects.exists()

    other = workers.start("--burst", "--queue", "default", JOBS_PROC_NAP="0.1")
    assert workers.wait(other) == 0, workers.stderr(other)
    assert list(rows.values_list("status", "attempt", "claims", "result")) == [(SUCCEEDED, 1, 2, {"pid": other.pid})] * 2
    assert sorted(log_lines(log)) == [(0, other.pid), (1, other.pid)]


def _collect_through_a_slow_signal() -> None:
    from leases.tasks.worker import JobWorker

    w = JobWorker(queues=["default"])
    signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.05))  # outlives the wait
    signal.setitimer(signal.ITIMER_REAL, 0.04)
    assert w._collect(wait=0.05) == []


def test_a_signal_at_the_end_of_the_outcome_wait_does_not_freeze_the_loop(processes):
    """The soak found a worker that ignored SIGTERM for good: a signal handled as the wait for
    outcomes timed out left CPython 3.11's SimpleQueue.get(timeout) blocked forever."""
    child = processes.start(_collect_through_a_slow_signal)
    child.join(10)
    assert child.exitcode == 0, "the wait for outcomes never returned"


def test_a_second_sigterm_exits_at_once_leaving_jobs_to_recovery(workers, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("nap", {"n": n, "log": str(log)}) for n in range(2)])
    proc = workers.start("--queue", "default", "--concurrency", "2", "--grace", "60", JOBS_PROC_NAP="60")
    taken = running_in(proc, 2)
    # Signals that arrive together count once, so keep signalling until the process is gone.
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
    assert proc.poll() == 1, workers.stderr(proc)
    assert "second stop request" in workers.stderr(proc)
    # Neither finished nor handed back: they wait for their lease to lapse.
    rows = Job.objects.filter(pk__in=taken)
    assert set(rows.values_list("status", "attempt")) == {(RUNNING, 1)}
    assert log_lines(log) == []


# -- fencing --------------------------------------------------------------------------------


def test_a_worker_stopped_past_its_ttl_cannot_overwrite_the_next_attempt(workers, tmp_path):
    log = tmp_path / "runs.log"
    ok = push("nap", {"n": 0, "seconds": 2, "log": str(log)}).pk
    failing = push("nap", {"n": 1, "seconds": 2, "log": str(log), "fail_in": "stale"}).pk
    stale = workers.start(
        "--queue", "default", "--concurrency", "2", "--max-jobs", "2", "--ttl", "1.5", JOBS_PROC_ROLE="stale"
    )
    running_in(stale, 2)
    os.kill(stale.pid, signal.SIGSTOP)  # mid-nap: no heartbeat, no outcome

    fresh = workers.start(
        "--queue", "default", "--concurrency", "2", "--max-jobs", "2", "--ttl", "1.5",
        JOBS_PROC_ROLE="fresh", JOBS_PROC_NAP="0.1",
    )
    assert workers.wait(fresh, 60) == 0, workers.stderr(fresh)
    won = states([ok, failing])
    for pk, (status, attempt, worker, result, _) in won.items():
        assert (status, attempt, result) == (SUCCEEDED, 2, {"pid": fresh.pid}), pk
        assert f":{fresh.pid}:" in worker
    errors = list(JobError.objects.values_list("job_id", "attempt", "exception"))
    assert sorted(errors) == [(ok, 1, LOST), (failing, 1, LOST)]

    os.kill(stale.pid, signal.SIGCONT)  # its naps end, its outcomes are fenced out
    assert workers.wait(stale, 60) == 0, workers.stderr(stale)
    assert sorted(pid for n, pid in log_lines(log) if pid == stale.pid) == [stale.pid] * 2, "the late attempts ran"
    assert states([ok, failing]) == won
    assert sorted(JobError.objects.values_list("job_id", "attempt", "exception")) == sorted(errors)
    assert "lease lapsed" in workers.stderr(stale)  # it noticed, and registered again


# -- bounded queues -------------------------------------------------------------------------


def bounded(when_full: str, full_timeout: float = 30.0, max_length: int = 3) -> list[int]:
    """A queue "bounded" holding its max_length of waiting noop jobs."""
    Queue.objects.create(name="bounded", max_length=max_length, when_full=when_full, full_timeout=full_timeout)
    return [push("noop", {"n": n}, queue="bounded").pk for n in range(max_length)]


def test_reject_raises_once_full_and_accepts_after_a_worker_drains(workers):
    bounded(Queue.REJECT)
    with pytest.raises(QueueFull, match="bounded"):
        push("noop", {"n": 3}, queue="bounded")
    with pytest.raises(QueueFull):
        push_many([("noop", {"n": 4}, {"queue": "bounded"})])
    assert Job.objects.count() == 3

    proc = workers.start("--burst", "--queue", "bounded")
    assert workers.wait(proc) == 0, workers.stderr(proc)
    assert push("noop", {"n": 3}, queue="bounded").status == READY
    assert Job.objects.filter(status=SUCCEEDED).count() == 3


def test_wait_blocks_until_a_worker_makes_room(workers):
    first = bounded(Queue.WAIT)
    proc = workers.start("--burst", "--queue", "bounded")
    job = push("noop", {"n": 3}, queue="bounded")  # full now: blocks until the worker claims
    assert job is not None and Job.objects.filter(pk=job.pk).exists()
    assert Job.objects.filter(pk__in=first).exclude(status=READY).exists(), "pushed with no room made"
    assert workers.wait(proc) == 0, workers.stderr(proc)


def test_wait_raises_after_full_timeout_when_no_worker_runs():
    bounded(Queue.WAIT, full_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(QueueFull):
        push("noop", {"n": 3}, queue="bounded")
    assert time.monotonic() - started >= 0.5
    assert Job.objects.count() == 3


def test_buffer_keeps_the_job_until_a_worker_makes_room(workers):
    bounded(Queue.BUFFER)
    assert push("noop", {"n": 3}, queue="bounded") is None
    assert jobqueue.buffered() == 1 and Job.objects.count() == 3
    dropped = jobpush._buffer.dropped

    proc = workers.start("--burst", "--queue", "bounded")
    assert jobqueue.flush_buffer(timeout=60)
    assert jobqueue.buffered() == 0 and jobpush._buffer.dropped == dropped
    assert Job.objects.filter(payload__n=3).count() == 1
    assert workers.wait(proc) == 0, workers.stderr(proc)


def test_buffer_drops_the_job_after_full_timeout_with_an_error(caplog):
    bounded(Queue.BUFFER, full_timeout=0.5)
    caplog.set_level(logging.WARNING, logger="leases.tasks")
    assert push("noop", {"n": 3}, queue="bounded") is None
    assert jobqueue.buffered() == 1
    dropped = jobpush._buffer.dropped
    assert jobqueue.flush_buffer(timeout=30)  # empty again: dropped counts as done
    assert jobqueue.buffered() == 0 and jobpush._buffer.dropped == dropped + 1
    assert Job.objects.count() == 3 and not Job.objects.filter(payload__n=3).exists()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "dropped 1 buffered job(s) of queue bounded" in errors[0].getMessage()


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--queue", "default,nosuch"], "unknown queue(s): nosuch"),
        (["--import", "no.such.module"], "--import no.such.module"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_registers_no_worker(manage, child_env, args, needle):
    argv = [*manage, "leases_worker", "--burst", "--import", "tests.jobs", *args]
    result = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not WorkerRow.objects.exists()


# -- queues it does not serve -----------------------------------------------------------------


def test_a_plain_worker_says_which_handlers_and_due_jobs_it_does_not_serve(manage, child_env):
    """`leases_worker --burst` serves queue default: echo's jobs (queue other) wait, and it
    says so twice, instead of exiting 0 with "0 claimed" while `jobs stats` shows them due."""
    job = push("echo", {"n": 1})
    argv = [*manage, "leases_worker", "--burst", "--import", "tests.jobs"]
    done = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    said = [line.split(": ", 1)[1] for line in done.stderr.splitlines()
            if " WARNING leases.tasks.worker: " in line]
    name = said[0].split()[1]
    assert said == [
        f"worker {name} serves queues default, not those of handlers echo (other): their jobs wait for"
        " another worker; to serve them too, --queue default,other or --queue '*'",
        f"worker {name} claimed nothing, but queues it does not serve have jobs due: other (1); serve them"
        " with --queue default,other or --queue '*'",
    ]
    assert Job.objects.get(pk=job.pk).status == READY
    served = subprocess.run([*argv, "--queue", "*"], env=child_env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert served.returncode == 0 and " WARNING " not in served.stderr, served.stderr
    assert Job.objects.get(pk=job.pk).status == SUCCEEDED
