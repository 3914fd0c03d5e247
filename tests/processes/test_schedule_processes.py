"""The scheduler in real `leases_worker` processes: however many run it, one leads and
each tick fires once; when the leader is SIGKILLed another takes over within its ttl."""
from __future__ import annotations

import os
import signal
import time

import pytest

import tests.jobs  # noqa: F401 - registers "noop", which the schedules push
from leases.clock import db_now
from leases.models import Lock
from leases.tasks import schedule
from leases.tasks.models import Job, ScheduleRun
from leases.tasks.schedules import set_enabled
from leases.tasks.schedules.leader import LOCK
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.usefixtures("fresh_queue_settings")]

TTL = 2.0


def leader() -> tuple[str, int] | None:
    """(holder, pid) of the worker holding the scheduler's lock now, by the database clock."""
    row = Lock.objects.filter(name=LOCK, expires_at__gt=db_now()).exclude(holder="").first()
    return (row.holder, int(row.holder.split(":")[1])) if row else None


def runs(name: str) -> list[ScheduleRun]:
    return list(ScheduleRun.objects.filter(schedule__name=name).order_by("number"))


def log_lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def start(workers, count: int = 3) -> list:
    procs = [workers.start("--queue", "default", "--ttl", str(TTL), "--concurrency", "2") for _ in range(count)]
    wait_for(leader, 30, "a worker to lead the scheduler")
    return procs


def stop(workers, procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        if proc.returncode is None or proc.returncode >= 0:
            workers.wait(proc)


def test_three_workers_fire_an_every_second_schedule_once_per_tick(workers, tmp_path):
    log = tmp_path / "runs.log"
    procs = start(workers)
    schedule("tick", "noop", every=1, payload={"log": str(log), "n": "tick"})
    time.sleep(12)
    set_enabled("tick", False)
    fired = runs("tick")
    assert 11 <= len(fired) <= 13, [run.tick_at for run in fired]
    ticks = [run.tick_at for run in fired]
    assert len(set(ticks)) == len(ticks) and ticks == sorted(ticks)
    # One job per tick, and each ran once (one line per run in the handler's log).
    assert Job.objects.filter(key__startswith="schedule:tick:").count() == len(fired)
    wait_for(lambda: len(log_lines(log)) >= len(fired), 20, "every fired job to run")
    time.sleep(0.5)
    assert len(log_lines(log)) == len(fired)
    stop(workers, procs)
    assert {run.status for run in runs("tick")} == {"succeeded"}


def test_when_the_leader_is_killed_another_worker_fires_the_next_ticks_within_its_ttl(workers, tmp_path):
    procs = start(workers)
    schedule("tick", "noop", every=1, payload={"n": "tick"})
    wait_for(lambda: len(runs("tick")) >= 3, 20, "three ticks")
    holder, pid = leader()
    os.kill(pid, signal.SIGKILL)
    killed_at = db_now()
    wait_for(lambda: any(run.fired_at > killed_at for run in runs("tick")), 20, "a tick after the kill")
    resumed = min(run.fired_at for run in runs("tick") if run.fired_at > killed_at)
    assert (resumed - killed_at).total_seconds() <= TTL + 1.0
    new_holder, new_pid = wait_for(leader, 10, "a new leader")
    assert new_pid != pid and new_holder != holder
    set_enabled("tick", False)
    ticks = [run.tick_at for run in runs("tick")]
    assert len(set(ticks)) == len(ticks) and ticks == sorted(ticks)
    assert Job.objects.filter(key__startswith="schedule:tick:").count() == len(ticks)
    stop(workers, [proc for proc in procs if proc.pid != pid])
