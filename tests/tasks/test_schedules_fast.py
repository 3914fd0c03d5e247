"""Schedules fired in bulk: a burst of due schedules fires each tick once, whatever the
batches, statements, races and lost replies, with each schedule moved on by its own
values; the leader sleeps until the soonest tick. The firing rules: test_schedules.
"""
from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import InterfaceError, connection, connections, transaction

from leases import db
from leases.clock import db_now
from leases.tasks import handler, schedule
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules import BATCH, RUN_ENDED, fire, fire_due, leader

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


@handler("fast.ping", queue="default")
def ping(payload):
    return payload


@handler("fast.limited", queue="default", max_attempts=5, limit_key="site", concurrency=2, rate="10/m")
def limited(payload):
    return payload


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def burst(count: int, at: datetime | None = None, **fields) -> datetime:
    """`count` schedules of fast.ping every 60 s, all due at `at` (default: the database
    clock now); returns that tick."""
    tick = at or db_now()
    fields = {"every": 60.0, **fields}
    Schedule.objects.bulk_create(
        Schedule(name=f"b{n:05d}", handler="fast.ping", timezone="UTC", payload={"n": n}, next_fire_at=tick,
                 created_at=tick, updated_at=tick, **fields)
        for n in range(count)
    )
    return tick


def assert_each_fired_once(count: int, tick: datetime) -> None:
    """Each schedule b00000... fired `tick` once, as run 1, naming the job of its key."""
    jobs = dict(Job.objects.values_list("key", "id"))
    runs = list(ScheduleRun.objects.values_list("schedule__name", "tick_at", "number", "job_id"))
    assert len(jobs) == len(runs) == count
    assert {name for name, *_ in runs} == {f"b{n:05d}" for n in range(count)}
    for name, tick_at, number, job_id in runs:
        assert (tick_at, number, job_id) == (tick, 1, jobs[f"schedule:{name}:{tick.isoformat()}"])
    moved = set(Schedule.objects.values_list("fires", "last_fire_at", "next_fire_at"))
    assert moved == {(1, tick, tick + timedelta(seconds=60))}


def test_a_burst_of_several_batches_fires_each_tick_once_and_names_its_job():
    tick = burst(BATCH * 2 + 7)
    assert fire_due(now=tick) == BATCH * 2 + 7
    assert fire_due(now=tick + timedelta(seconds=30)) == 0
    assert_each_fired_once(BATCH * 2 + 7, tick)
    assert set(Job.objects.values_list("name", "queue", "on_finish")) == {("fast.ping", "default", RUN_ENDED)}


def test_schedules_of_one_batch_move_on_by_their_own_values():
    t0 = utc(2030, 1, 1, 12)
    rows = {
        "all": {"every": 10.0, "catch_up": "all"},              # 25 s late: 3 ticks
        "last": {"every": 10.0, "fires": 7, "last_fire_at": t0 - timedelta(seconds=10)},
        "none": {"every": 3600.0, "catch_up": "none", "fires": 2, "last_fire_at": t0 - timedelta(hours=1)},
        "minute": {"every": 60.0, "fires": 41},
    }
    for name, fields in rows.items():
        Schedule.objects.create(name=name, handler="fast.ping", timezone="UTC", next_fire_at=t0, created_at=t0,
                                updated_at=t0, **fields)
    Schedule.objects.filter(name="none").update(next_fire_at=t0 - timedelta(minutes=30))  # too late to fire
    assert fire_due(now=t0 + timedelta(seconds=25)) == 3 + 1 + 0 + 1
    moved = {row.name: (row.fires, row.last_fire_at, row.next_fire_at) for row in Schedule.objects.all()}
    assert moved == {
        "all": (3, t0 + timedelta(seconds=20), t0 + timedelta(seconds=30)),
        "last": (8, t0 + timedelta(seconds=20), t0 + timedelta(seconds=30)),
        "none": (2, t0 - timedelta(hours=1), t0 + timedelta(minutes=30)),
        "minute": (42, t0, t0 + timedelta(seconds=60)),
    }
    numbers = sorted(ScheduleRun.objects.values_list("schedule__name", "number"))
    assert numbers == [("all", 1), ("all", 2), ("all", 3), ("last", 8), ("minute", 42)]


def test_a_shared_move_adds_to_each_schedules_own_count():
    tick = burst(3)
    for n, fires in enumerate((0, 5, 99)):
        Schedule.objects.filter(name=f"b{n:05d}").update(fires=fires)
    assert fire_due(now=tick) == 3
    assert sorted(Schedule.objects.values_list("fires", flat=True)) == [1, 6, 100]
    assert sorted(ScheduleRun.objects.values_list("number", flat=True)) == [1, 6, 100]


def test_a_scheduled_job_takes_its_handlers_settings():
    row = schedule("limited", "fast.limited", every=60, payload={"site": "a"}, priority=3)
    assert fire_due(now=row.next_fire_at) == 1
    job = Job.objects.get()
    assert (job.queue, job.max_attempts, job.limit_key, job.concurrency, job.rate, job.priority, job.on_finish) == (
        "default", 5, "site", 2, "10/m", 3, RUN_ENDED)
    assert ScheduleRun.objects.get().job_id == job.pk


def test_cron_schedules_of_a_burst_each_get_their_own_expressions_ticks():
    tick = utc(2030, 1, 1, 12)
    Schedule.objects.bulk_create(
        Schedule(name=f"c{n:03d}", handler="fast.ping", cron="*/5 * * * *" if n % 2 else "0 * * * *",
                 timezone="Europe/Berlin", next_fire_at=tick, created_at=tick, updated_at=tick)
        for n in range(300)
    )
    assert fire_due(now=tick + timedelta(seconds=30)) == 300
    following = dict(Schedule.objects.values_list("name", "next_fire_at"))
    assert following == {f"c{n:03d}": tick + timedelta(minutes=5 if n % 2 else 60) for n in range(300)}
    assert set(ScheduleRun.objects.values_list("tick_at", flat=True)) == {tick}


def test_history_is_trimmed_for_the_schedules_that_outgrew_it(settings):
    settings.LEASES_KEEP_RUNS = 3
    tick = burst(2)
    Schedule.objects.filter(name="b00001").update(next_fire_at=tick + timedelta(days=1))
    for step in range(3):  # b00000 fires alone: runs 1, 2, 3
        fire_due(now=tick + timedelta(seconds=60 * step))
    Schedule.objects.filter(name="b00001").update(next_fire_at=tick + timedelta(seconds=180))
    assert fire_due(now=tick + timedelta(seconds=180)) == 2  # both in one batch; only b00000 is over
    numbers = sorted(ScheduleRun.objects.values_list("schedule__name", "number"))
    assert numbers == [("b00000", 2), ("b00000", 3), ("b00000", 4), ("b00001", 1)]


def test_every_lane_trims_the_history_of_the_schedules_it_fired(settings):
    settings.LEASES_KEEP_RUNS = 2
    count = BATCH * 2 + 3
    tick = burst(count, fires=2, last_fire_at=utc(2030, 1, 1))
    ScheduleRun.objects.bulk_create(
        ScheduleRun(schedule_id=pk, number=number, tick_at=utc(2030, 1, 1, 0, number), fired_at=utc(2030, 1, 1))
        for pk in Schedule.objects.values_list("pk", flat=True) for number in (1, 2)
    )
    assert fire_due(now=tick) == count
    numbers = ScheduleRun.objects.values_list("schedule_id", "number")
    assert sorted(number for _, number in numbers) == [2] * count + [3] * count


@pytest.mark.parametrize("per_statement, chars, statements", [(7, 2 << 20, 3), (1000, 20, 11)])
def test_ticks_beyond_one_statement_are_written_in_several(monkeypatch, per_statement, chars, statements):
    writes, real = [], fire.write
    monkeypatch.setattr(fire, "write", lambda cursor, jobs, **kw: writes.append(len(jobs)) or real(cursor, jobs, **kw))
    monkeypatch.setattr(fire, "PER_STATEMENT", per_statement)
    monkeypatch.setattr(fire, "BATCH_CHARS", chars)  # payloads {"n":0}: 7 characters
    tick = burst(1, every=1.0, catch_up="all")
    assert fire_due(now=tick + timedelta(seconds=20)) == 21
    assert len(writes) == statements and sum(writes) == 21
    jobs = dict(Job.objects.values_list("key", "id"))
    runs = list(ScheduleRun.objects.order_by("number").values_list("tick_at", "job_id"))
    assert [tick_at for tick_at, _ in runs] == [tick + timedelta(seconds=n) for n in range(21)]
    assert [job_id for _, job_id in runs] == [jobs[f"schedule:b00000:{t.isoformat()}"] for t, _ in runs]


def test_a_reply_lost_after_commit_fires_nothing_twice(monkeypatch):
    tick = burst(BATCH + 5)
    real, seen = db.run, []

    def losing(work, using=None, attempts=8):
        def once(cursor, resumed):
            result = work(cursor, resumed)
            seen.append(resumed)
            if len(seen) == 1:  # the first batch committed; its reply never arrives
                raise InterfaceError(2013, "Lost connection to server during query")
            return result

        return real(once, using, attempts)

    monkeypatch.setattr(db, "run", losing)
    fire_due(now=tick)
    monkeypatch.undo()
    assert seen[0] is False and seen.count(True) == 1  # one retry, not knowing whether it committed
    assert_each_fired_once(BATCH + 5, tick)


def test_a_burst_is_fired_by_lanes_side_by_side_each_tick_once(monkeypatch):
    lanes, real = [], fire._lane

    def counted(using, now, deadline, fires=None):
        result = real(using, now, deadline, fires)
        lanes.append((threading.current_thread().name, result[0]))
        return result

    monkeypatch.setattr(fire, "_lane", counted)
    count = BATCH * 6
    tick = burst(count)
    assert fire_due(now=tick) == count
    assert_each_fired_once(count, tick)
    names = sorted(name for name, _ in lanes)
    side_by_side = connection.features.has_select_for_update_skip_locked
    assert names == (["MainThread"] + ["leases-scheduler-lane"] * (fire.LANES - 1) if side_by_side else ["MainThread"])


def test_an_error_in_a_lane_reaches_the_caller(monkeypatch):
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("one lane where rows cannot be skipped")
    real = fire._batch

    def failing(using, now, fires):
        if threading.current_thread().name == "leases-scheduler-lane":
            raise RuntimeError("a lane failed")
        return real(using, now, fires)

    monkeypatch.setattr(fire, "_batch", failing)
    tick = burst(BATCH * 3)
    with pytest.raises(RuntimeError, match="a lane failed"):
        fire_due(now=tick)
    assert ScheduleRun.objects.count() == BATCH * 3  # the caller's lane fired them all


def _fire(now: datetime) -> None:
    fire_due(now=now)


def test_two_schedulers_racing_fire_each_tick_once(processes):
    count = BATCH * 4
    tick = burst(count)
    for _ in range(2):
        processes.start(_fire, tick)
    processes.join_all()
    assert_each_fired_once(count, tick)


def test_the_leader_sleeps_until_the_soonest_tick_and_fires_it_then(monkeypatch):
    monkeypatch.setattr(leader, "PASS_EVERY", 5.0)  # far longer than the wait seen below
    scheduler = leader.Scheduler("fast-leader", ttl=30.0, using="default")
    try:
        assert scheduler.step() > 2.5  # nothing scheduled: the next pass is a whole pass away
        tick = burst(1, at=db_now() + timedelta(seconds=1.5))
        scheduler._next = 0.0  # the pass after the one above
        wait = scheduler.step()
        assert 0.0 < wait < 1.6  # until the tick
        for _ in range(5):
            threading.Event().wait(wait)
            wait = scheduler.step()
            if ScheduleRun.objects.exists():
                break
        run = ScheduleRun.objects.get()
        pushed = Job.objects.get(pk=run.job_id).enqueued_at
        assert run.tick_at == tick and (pushed - tick).total_seconds() < 1.0
    finally:
        scheduler.stop()


def _hold(name: str, held: threading.Event, release: threading.Event) -> None:
    try:
        with transaction.atomic():
            list(Schedule.objects.select_for_update().filter(name=name))
            held.set()
            release.wait(10)
    finally:
        connections.close_all()


def test_a_tick_another_pass_holds_is_tried_again_soon_not_at_once():
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("no row locks: passes take turns on the database's write lock")
    burst(1)
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=("b00000", held, release))
    holder.start()
    scheduler = leader.Scheduler("fast-leader", ttl=30.0, using="default")
    try:
        assert held.wait(10)
        assert scheduler.step() == pytest.approx(leader.RETRY_AFTER, abs=0.04)
        assert not ScheduleRun.objects.exists()
    finally:
        release.set()
        holder.join(10)
        scheduler.stop()
