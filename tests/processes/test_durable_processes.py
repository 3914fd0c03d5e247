"""Durable handlers under real `manage.py leases_worker` processes, as users run them.

What only processes can show: a worker SIGKILLed inside a step, whose jobs another worker
resumes after their completed steps (each completed step's body ran once, the one the
kill cut short ran again, the stored results are those of the runs that completed); a
running job cancelled from another process, by a handler that cooperates and by one that
ignores it (abandoned after the grace, the worker going on); a thousand `async def`
handlers overlapping on one worker's event loop; and two hundred durable sleeps that
hold none of the worker's slots.

The handlers (tests/jobs_durable.py) log what ran where to files, so runs are counted
across processes without trusting the database under test.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import tests.jobs  # noqa: F401 - registers noop, for the plain jobs pushed beside durable ones
import tests.jobs_durable  # noqa: F401 - registers the durable handlers
from leases.clock import db_now
from leases.tasks import push, push_many
from leases.tasks.jobs import actions
from leases.tasks.models import Job, JobError, JobStep
from tests.conftest import wait_for
from tests.helpers import log_lines
from tests.jobs_durable import SLOW, STEPS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow,
              pytest.mark.usefixtures("fresh_queue_settings")]

#: Every worker here loads the durable handlers besides the usual test modules.
DURABLE = ("--import", "tests.jobs_durable")
LOST = "leases.exceptions.WorkerLost"


def lines(path: Path, kind: str) -> list[list[str]]:
    """The fields after `kind` of each line of that kind in a handler's log."""
    if not path.exists():
        return []
    return [line.split()[1:] for line in path.read_text().splitlines() if line.split()[0] == kind]


def of(proc: subprocess.Popen):
    """Jobs whose `worker` is this process (worker names are host:pid:random)."""
    return Job.objects.filter(worker__contains=f":{proc.pid}:")


def stop(workers, proc: subprocess.Popen) -> None:
    """SIGTERM a worker that must still be alive; it exits 0 without a traceback."""
    assert proc.poll() is None, f"worker {proc.pid} died:\n{workers.stderr(proc)}"
    os.kill(proc.pid, signal.SIGTERM)
    assert workers.wait(proc, 60) == 0, workers.stderr(proc)
    assert "Traceback" not in workers.stderr(proc), workers.stderr(proc)


def run_plain_job(workers, proc: subprocess.Popen, log: Path, n: int, timeout: float = 30) -> None:
    """Push a plain job and see `proc` run it: the worker goes on serving."""
    job = push("noop", {"n": n, "log": str(log)})
    wait_for(lambda: Job.objects.filter(pk=job.pk, status=Job.SUCCEEDED).exists(), timeout,
             f"plain job {n} to succeed ({workers.stderr(proc)[-2000:]})")
    assert (n, proc.pid) in log_lines(log)


# -- SIGKILL mid-step -------------------------------------------------------------------------


def test_a_worker_sigkilled_inside_a_step_leaves_its_jobs_to_resume_after_their_completed_steps(
        workers, tmp_path):
    log, entries = tmp_path / "steps.log", tmp_path / "entries.log"
    jobs = {n: push("durable-steps", {"n": n, "log": str(log), "entries": str(entries), "slow": 0.2}).pk
            for n in range(8)}
    # Its slow step lasts a minute: each of its four jobs is inside it when the kill comes.
    killed = workers.start(*DURABLE, "--concurrency", "4", "--ttl", "1.5", JOBS_DURABLE_SLOW="60")

    def inside_slow() -> list[int]:
        return [int(n) for n, index, pid in lines(log, "begin")
                if int(index) == SLOW and int(pid) == killed.pid]

    cut = set(wait_for(lambda: len(inside_slow()) == 4 and inside_slow(), 60, "4 jobs inside the slow step"))
    os.kill(killed.pid, signal.SIGKILL)
    assert workers.wait(killed) == -signal.SIGKILL
    assert not lines(log, "end") or all(int(index) < SLOW for _, index, _, _ in lines(log, "end"))

    # A worker with a short ttl recovers them once the dead one's heartbeat lapsed, and runs the rest.
    taker = workers.start(*DURABLE, "--concurrency", "4", "--ttl", "1.5")
    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == 8, 60,
             f"8 jobs succeeded ({workers.stderr(taker)[-2000:]})")
    stop(workers, taker)

    # The handler was entered again only by the jobs the kill cut short.
    assert Counter(int(n) for n, *_ in lines(entries, "entry")) == {n: 2 if n in cut else 1 for n in jobs}
    # Each step's body began once, but the slow one of those jobs, which began twice...
    began = Counter((int(n), int(index)) for n, index, _ in lines(log, "begin"))
    assert began == {(n, i): 2 if n in cut and i == SLOW else 1 for n in jobs for i in range(len(STEPS))}
    # ... and each ended once: no completed step ran again.
    ended = {}
    for n, index, pid, token in lines(log, "end"):
        assert (int(n), int(index)) not in ended, f"step {index} of job {n} completed twice"
        ended[int(n), int(index)] = (int(pid), token)
    assert set(ended) == set(began)
    for n in cut:  # the steps before the kill completed in the dead worker, the rest in the taker
        where = [ended[n, i][0] for i in range(len(STEPS))]
        assert where == [killed.pid] * SLOW + [taker.pid] * (len(STEPS) - SLOW)

    for n, pk in jobs.items():
        job = Job.objects.get(pk=pk)
        assert (job.status, job.attempt) == (Job.SUCCEEDED, 2 if n in cut else 1), n
        stored = list(JobStep.objects.filter(job_id=pk).order_by("seq")
                      .values_list("seq", "name", "result", "done"))
        # Each step's stored result is the one its completed run returned, and the job returns them.
        expected = [{"token": ended[n, i][1], "index": i} for i in range(len(STEPS))]
        assert stored == [(i + 1, name, expected[i], True) for i, name in enumerate(STEPS)], n
        assert job.result == expected, n
    errors = JobError.objects.values_list("job_id", "exception")
    assert sorted(errors) == sorted((jobs[n], LOST) for n in cut)


# -- cancelling a running job from another process ----------------------------------------------

#: The workers' heartbeat lease: the heartbeat runs every third of it.
TTL = 3.0
HEARTBEAT = TTL / 3
#: Slack for a loaded machine; a cooperative end must still come well before the grace.
MARGIN = 10.0


def cancel_from_outside(job_id: int, how: str, manage: list[str], env: dict) -> None:
    if how == "command":
        done = subprocess.run([*manage, "jobs", "cancel", str(job_id)], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "1 running: asked to stop" in done.stdout, done.stdout
    else:
        assert actions.cancel([job_id]) == 1


def ended_cancelled(pk: int, timeout: float) -> Job:
    wait_for(lambda: Job.objects.filter(pk=pk).exclude(status=Job.RUNNING).exists(), timeout,
             f"job {pk} to end")
    job = Job.objects.get(pk=pk)
    assert job.status == Job.CANCELLED, (job.status, job.result)
    return job


@pytest.mark.parametrize(("mode", "how"), [("check", "command"), ("step", "api")])
def test_a_cooperative_handler_cancelled_from_another_process_stops_within_a_heartbeat(
        workers, manage, child_env, tmp_path, mode, how):
    entries, plain = tmp_path / "entries.log", tmp_path / "plain.log"
    # A grace far beyond the margin: ending in time is the handler's doing, not an abandonment.
    proc = workers.start(*DURABLE, "--concurrency", "1", "--ttl", str(TTL), "--grace", "60")
    job = push("durable-cooperative", {"n": 1, "mode": mode, "entries": str(entries), "seconds": 120})
    wait_for(lambda: lines(entries, "entry"), 60, "the handler to start")
    cancel_from_outside(job.pk, how, manage, child_env)

    job = ended_cancelled(job.pk, HEARTBEAT + MARGIN)
    took = (job.finished_at - job.cancel_requested_at).total_seconds()  # both by the database's clock
    assert took < HEARTBEAT + MARGIN
    error = JobError.objects.get(job_id=job.pk)
    assert error.exception == "leases.exceptions.Cancelled"
    own = "saw ctx.cancelled" if mode == "check" else f"job #{job.pk} was cancelled while it ran"
    assert own in error.message and "abandoned" not in error.message
    if mode == "step":  # its ticks stop at the cancel: none is stored after it
        assert JobStep.objects.filter(job_id=job.pk, name="tick").exists()
        assert not JobStep.objects.filter(job_id=job.pk, at__gt=job.finished_at).exists()
    run_plain_job(workers, proc, plain, 7)
    stop(workers, proc)


def test_an_uncooperative_handler_cancelled_from_another_process_is_abandoned_after_the_grace(
        workers, manage, child_env, tmp_path):
    entries, plain = tmp_path / "entries.log", tmp_path / "plain.log"
    grace, sleeps = 2.0, 10.0
    # One slot: the job that follows runs only if the stuck thread's slot was given a new one.
    proc = workers.start(*DURABLE, "--concurrency", "1", "--ttl", str(TTL), "--grace", str(grace))
    job = push("durable-stubborn", {"n": 1, "entries": str(entries), "seconds": sleeps})
    wait_for(lambda: lines(entries, "entry"), 60, "the handler to start")
    # By the API, at once: the handler must still be asleep when its grace runs out.
    cancel_from_outside(job.pk, "api", manage, child_env)

    job = ended_cancelled(job.pk, HEARTBEAT + grace + MARGIN)
    took = (job.finished_at - job.cancel_requested_at).total_seconds()
    assert grace - 0.5 <= took < HEARTBEAT + grace + MARGIN
    error = JobError.objects.get(job_id=job.pk)
    assert error.exception == "leases.exceptions.Cancelled" and "abandoned" in error.message
    assert not lines(entries, "exit"), "the handler returned before it was abandoned: nothing was proved"

    run_plain_job(workers, proc, plain, 7)
    # When the stuck handler finally returns, its late outcome is fenced out.
    wait_for(lambda: lines(entries, "exit"), sleeps + MARGIN, "the abandoned handler to return")
    run_plain_job(workers, proc, plain, 8)
    job.refresh_from_db()
    assert (job.status, job.result) == (Job.CANCELLED, None)
    assert JobError.objects.filter(job_id=job.pk).count() == 1
    stop(workers, proc)


# -- async handlers ---------------------------------------------------------------------------


def test_a_thousand_async_handlers_overlap_on_one_worker_loop(workers, tmp_path):
    log = tmp_path / "async.log"
    total = 1000
    pushed = push_many([("durable-async", {"n": n, "log": str(log), "seconds": 0.1}) for n in range(total)])
    assert pushed == total
    began = time.monotonic()
    proc = workers.start(*DURABLE, "--burst", "--concurrency", "100")
    assert workers.wait(proc, 120) == 0, workers.stderr(proc)
    took = time.monotonic() - began
    assert "Traceback" not in workers.stderr(proc), workers.stderr(proc)

    assert Job.objects.filter(status=Job.SUCCEEDED, attempt=1).count() == total
    assert sorted(Job.objects.values_list("result", flat=True)) == list(range(total))
    starts, ends = lines(log, "start"), lines(log, "end")
    assert sorted(int(n) for n, *_ in starts) == sorted(int(n) for n, *_ in ends) == list(range(total))
    assert {int(pid) for *_, pid in starts + ends} == {proc.pid}
    # Most in flight at once: +1 at each start, -1 at each end (an end before a start at a tie).
    moments = sorted([(float(t), 1) for _, t, _ in starts] + [(float(t), -1) for _, t, _ in ends])
    flight = peak = 0
    for _, change in moments:
        flight += change
        peak = max(peak, flight)
    assert 50 <= peak <= 100, f"at most {peak} handlers in flight at once"
    assert took < 60, f"1,000 handlers of 0.1 s at concurrency 100 took {took:.1f}s"


# -- durable sleeps hold no slot ----------------------------------------------------------------


def threads_of(pid: int) -> int | None:
    """Threads of a process, from /proc (None where there is none)."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return None
    found = [line.split()[1] for line in status.read_text().splitlines() if line.startswith("Threads:")]
    return int(found[0]) if found else None


def test_two_hundred_durable_sleeps_hold_none_of_four_slots(workers, tmp_path):
    entries, plain = tmp_path / "entries.log", tmp_path / "plain.log"
    total = 200
    push_many([("durable-sleeper", {"n": n, "entries": str(entries), "seconds": 3600}) for n in range(total)])
    proc = workers.start(*DURABLE, "--concurrency", "4")
    sleeping = Job.objects.filter(name="durable-sleeper", status=Job.READY, waiting_for="sleep")
    wait_for(lambda: sleeping.count() == total, 90, f"{total} jobs asleep ({workers.stderr(proc)[-2000:]})")

    # Plain jobs pushed after them run at once: the sleepers left the four slots free.
    began = time.monotonic()
    ids = [push("noop", {"n": n, "log": str(plain)}).pk for n in range(20)]
    wait_for(lambda: Job.objects.filter(pk__in=ids, status=Job.SUCCEEDED).count() == 20, 30,
             f"20 plain jobs to succeed ({workers.stderr(proc)[-2000:]})")
    assert time.monotonic() - began < 30
    assert {pid for _, pid in log_lines(plain)} == {proc.pid}
    count = threads_of(proc.pid)
    assert count is None or count < 50, f"the worker runs {count} threads for {total} sleeping jobs"

    now = db_now()
    # Each sleeper ran once up to its sleep (its try given back) and waits in the database for
    # its end, an hour away.
    assert sleeping.filter(attempt=0).count() == total
    assert not Job.objects.filter(name="durable-sleeper").exclude(status=Job.READY).exists()
    assert Counter(int(n) for n, _ in lines(entries, "entry")) == {n: 1 for n in range(total)}
    assert JobStep.objects.filter(name="before", done=True).count() == total
    naps = dict(JobStep.objects.filter(name="sleep", done=False).values_list("job_id", "until"))
    wakes = dict(sleeping.values_list("pk", "run_at"))
    assert naps == wakes  # each runs again at its sleep's end...
    assert all(3500 < (when - now).total_seconds() <= 3600 for when in wakes.values())  # ... an hour away
    stop(workers, proc)
    assert sleeping.count() == total  # a graceful stop leaves them asleep
