"""Schedules in one process, with a controlled clock where time matters (`fire_due(now=...)`):
ticks and catch-up, cron across DST changes, disabled and one-off schedules, pipelines,
LEASES_SCHEDULES, the runs' history and bad input. JobWorker processes: test_schedule_processes.
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import IntegrityError, transaction
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.pipes  # noqa: F401 - registers crawl-site and its handlers
from leases.clock import db_now
from leases.exceptions import UnknownHandler
from leases.pipelines.models import Run
from leases.tasks import handler, schedule, unschedule
from leases.tasks import schedules as sched
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules import Timing, check_timing, fire_due, fire_now, set_enabled
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

BERLIN = "Europe/Berlin"


@handler("sched.ping", queue="default", backoff=0.0)
def ping(payload):
    return {"pong": payload}


@handler("sched.fail", queue="default", max_attempts=1)
def fail(payload):
    raise RuntimeError("scheduled failure")


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def ticks(name: str) -> list[datetime]:
    return list(ScheduleRun.objects.filter(schedule__name=name).order_by("number").values_list("tick_at", flat=True))


def drain() -> None:
    JobWorker(queues=["default"], concurrency=2, burst=True, poll=0.01).run()


def starting_at(name: str, first: datetime) -> Schedule:
    """Move a schedule's next tick (the clock of these tests is `fire_due(now=...)`)."""
    Schedule.objects.filter(name=name).update(next_fire_at=first)
    return Schedule.objects.get(name=name)


# -- firing ---------------------------------------------------------------------------


def test_an_every_schedule_fires_each_tick_once_with_its_key_and_payload():
    row = schedule("ping", "sched.ping", every=30, payload={"n": 1})
    now = db_now()
    assert 29 <= (row.next_fire_at - now).total_seconds() <= 31
    first = row.next_fire_at
    assert fire_due(now=first - timedelta(seconds=1)) == 0
    assert fire_due(now=first) == 1
    assert fire_due(now=first + timedelta(seconds=10)) == 0  # the same tick is not fired again
    assert fire_due(now=first + timedelta(seconds=30)) == 1
    assert ticks("ping") == [first, first + timedelta(seconds=30)]
    jobs = list(Job.objects.order_by("pk").values_list("name", "key", "payload", "queue"))
    assert jobs == [("sched.ping", f"schedule:ping:{t.isoformat()}", {"n": 1}, "default") for t in ticks("ping")]
    row.refresh_from_db()
    assert (row.fires, row.last_fire_at, row.next_fire_at) == (2, first + timedelta(seconds=30),
                                                               first + timedelta(seconds=60))


def test_a_runs_status_duration_and_error_are_recorded_when_its_job_ends():
    schedule("ok", "sched.ping", every=60)
    schedule("bad", "sched.fail", every=60)
    for name in ("ok", "bad"):
        fire_now(name)
    drain()
    ok, bad = (ScheduleRun.objects.get(schedule__name=name) for name in ("ok", "bad"))
    assert (ok.status, ok.error, ok.tick_at) == ("succeeded", "", None)  # fired by hand: no tick
    assert ok.started_at <= ok.finished_at
    assert (bad.status, bad.error) == ("dead", "RuntimeError: scheduled failure")


def test_a_discarded_or_cancelled_job_says_so_in_its_run():
    from leases.tasks import queue as jobqueue

    schedule("a", "sched.ping", every=60)
    schedule("b", "sched.ping", every=60)
    one, two = fire_now("a"), fire_now("b")
    assert jobqueue.cancel([one.job_id]) == 1 and jobqueue.discard([two.job_id]) == 1
    one.refresh_from_db()
    two.refresh_from_db()
    assert (one.status, two.status) == ("cancelled", "discarded")


def test_a_schedule_keeps_its_newest_runs(settings):
    settings.LEASES_KEEP_RUNS = 3
    row = schedule("ping", "sched.ping", every=10)
    for step in range(6):
        fire_due(now=row.next_fire_at + timedelta(seconds=10 * step))
    assert list(ScheduleRun.objects.order_by("number").values_list("number", flat=True)) == [4, 5, 6]


def test_a_tick_is_unique_per_schedule():
    row = schedule("ping", "sched.ping", every=10)
    fire_due(now=row.next_fire_at)
    run = ScheduleRun.objects.get()
    with pytest.raises(IntegrityError), transaction.atomic():
        ScheduleRun.objects.create(schedule=row, number=99, tick_at=run.tick_at, fired_at=run.fired_at)


def test_a_disabled_schedule_does_not_fire_until_enabled():
    row = schedule("ping", "sched.ping", every=10, enabled=False)
    assert row.next_fire_at is None
    assert fire_due(now=db_now() + timedelta(days=1)) == 0
    assert set_enabled("ping", True) is True and set_enabled("ping", True) is False
    row.refresh_from_db()
    assert fire_due(now=row.next_fire_at) == 1
    assert set_enabled("ping", False) is True
    assert fire_due(now=db_now() + timedelta(days=1)) == 0 and len(ticks("ping")) == 1


def test_a_one_off_fires_once_and_then_has_no_next_tick():
    at = db_now() + timedelta(hours=1)
    row = schedule("launch", "sched.ping", at=at)
    assert row.next_fire_at == at
    assert fire_due(now=at + timedelta(days=3)) == 1
    row.refresh_from_db()
    assert row.next_fire_at is None and ticks("launch") == [at]
    assert fire_due(now=at + timedelta(days=4)) == 0


def test_schedule_again_updates_and_a_new_timing_starts_from_the_clock():
    schedule("ping", "sched.ping", every=10, payload={"v": 1})
    first = Schedule.objects.get().next_fire_at
    schedule("ping", "sched.ping", every=10, payload={"v": 2}, priority=5)
    row = Schedule.objects.get()
    assert (row.payload, row.priority, row.next_fire_at) == ({"v": 2}, 5, first)  # same timing: same tick
    schedule("ping", "sched.ping", every=3600)
    row.refresh_from_db()
    assert row.next_fire_at - db_now() > timedelta(minutes=59)
    assert unschedule("ping") is True and unschedule("ping") is False


# -- catch-up -------------------------------------------------------------------------


@pytest.mark.parametrize("policy, fired", [("last", 1), ("all", 10), ("none", 0)])
def test_after_a_stop_each_catch_up_policy(policy, fired):
    row = starting_at(schedule("five", "sched.ping", cron="*/5 * * * *", catch_up=policy).name,
                      utc(2030, 1, 1, 12, 0))
    # Down from 12:00 to 12:47:30: the ticks 12:00 ... 12:45 were missed.
    assert fire_due(now=utc(2030, 1, 1, 12, 47, 30)) == fired
    expected = {"last": [utc(2030, 1, 1, 12, 45)], "all": [utc(2030, 1, 1, 12, m) for m in range(0, 50, 5)],
                "none": []}[policy]
    assert ticks(row.name) == expected
    row.refresh_from_db()
    assert row.next_fire_at == utc(2030, 1, 1, 12, 50)  # back on the sequence either way


def test_catch_up_none_still_fires_a_tick_that_is_only_a_little_late():
    row = starting_at(schedule("five", "sched.ping", cron="*/5 * * * *", catch_up="none").name,
                      utc(2030, 1, 1, 12, 0))
    assert fire_due(now=utc(2030, 1, 1, 12, 0, 40)) == 1  # 40 s late: a failover, not a stop
    assert ticks(row.name) == [utc(2030, 1, 1, 12, 0)]


def test_catch_up_all_fires_at_most_the_newest_thousand_ticks():
    row = starting_at(schedule("fast", "sched.ping", every=1, catch_up="all").name, utc(2030, 1, 1))
    assert fire_due(now=utc(2030, 1, 1, 2)) == 1000  # two hours of one-second ticks missed
    keys = sorted(Job.objects.values_list("key", flat=True))
    newest = [utc(2030, 1, 1, 2) - timedelta(seconds=n) for n in range(999, -1, -1)]
    assert keys == [f"schedule:{row.name}:{tick.isoformat()}" for tick in newest]
    assert len(ticks(row.name)) == 100  # the history keeps LEASES_KEEP_RUNS of them


# -- cron in a time zone, across DST changes --------------------------------------------


def test_cron_fires_in_its_time_zone():
    timing = Timing(cron="0 3 * * *", timezone=BERLIN)
    assert timing.upcoming(timing.after(utc(2030, 1, 10)), 2) == [utc(2030, 1, 10, 2), utc(2030, 1, 11, 2)]
    assert timing.after(utc(2030, 7, 10)) == utc(2030, 7, 10, 1)  # summer time: UTC+2
    assert Timing(cron="0 3 * * *", timezone=BERLIN).describe() == "At 03:00 every day (Europe/Berlin)"


def fire_every_five_minutes(start: datetime, end: datetime) -> None:
    """A leader's passes, every five minutes by a clock the test moves."""
    clock = start
    while clock <= end:
        fire_due(now=clock)
        clock += timedelta(minutes=5)


def test_a_wall_clock_time_that_does_not_exist_fires_once_at_the_next_valid_minute():
    # 2027-03-28 in Berlin: clocks go from 02:00 CET straight to 03:00 CEST.
    row = starting_at(schedule("nightly", "sched.ping", cron="30 2 * * *", timezone=BERLIN).name,
                      utc(2027, 3, 27, 1, 30))
    fire_every_five_minutes(utc(2027, 3, 27, 0), utc(2027, 3, 30))
    assert ticks(row.name) == [
        utc(2027, 3, 27, 1, 30),  # 02:30 CET
        utc(2027, 3, 28, 1, 0),   # 02:30 does not exist: 03:00 CEST
        utc(2027, 3, 29, 0, 30),  # 02:30 CEST
    ]


def test_a_wall_clock_time_that_happens_twice_fires_once():
    # 2027-10-31 in Berlin: clocks go back from 03:00 CEST to 02:00 CET; 02:30 happens twice.
    row = starting_at(schedule("nightly", "sched.ping", cron="30 2 * * *", timezone=BERLIN).name,
                      utc(2027, 10, 30, 0, 30))
    fire_every_five_minutes(utc(2027, 10, 30, 0), utc(2027, 11, 2))
    assert ticks(row.name) == [
        utc(2027, 10, 30, 0, 30),  # 02:30 CEST
        utc(2027, 10, 31, 0, 30),  # the first 02:30, CEST; not again an hour later
        utc(2027, 11, 1, 1, 30),   # 02:30 CET
    ]


# -- pipelines and settings -----------------------------------------------------------


def test_a_pipeline_schedule_starts_runs_with_its_context():
    row = schedule("refresh", pipeline="crawl-site", every=60, context={"items": 2})
    assert row.handler == "" and row.pipeline == "crawl-site"
    assert fire_due(now=row.next_fire_at) == 1
    job = Job.objects.get()
    assert job.name == "leases.pipelines.start"
    drain()
    run = Run.objects.get()
    assert (run.pipeline, run.context, run.status) == ("crawl-site", {"items": 2}, Run.SUCCEEDED)
    assert run.key == job.key == f"schedule:refresh:{row.next_fire_at.isoformat()}"
    assert ScheduleRun.objects.get().status == "succeeded" and Job.objects.get(pk=job.pk).result["run"] == run.pk


def test_leases_schedules_are_applied_and_changes_apply_at_the_next_start(settings):
    schedule("mine", "sched.ping", every=60)  # made through the API: left alone
    settings.LEASES_SCHEDULES = {
        "ping": {"handler": "sched.ping", "every": 30, "payload": {"from": "settings"}},
        "nightly": {"handler": "sched.ping", "cron": "0 3 * * *", "timezone": BERLIN},
    }
    call_command("leases_worker", "--queue", "default", "--burst")
    rows = {row.name: row for row in Schedule.objects.all()}
    assert {name: row.source for name, row in rows.items()} == {"mine": "api", "ping": "settings", "nightly": "settings"}
    assert rows["ping"].payload == {"from": "settings"}
    settings.LEASES_SCHEDULES = {"ping": {"handler": "sched.ping", "every": 45}}
    call_command("leases_worker", "--queue", "default", "--burst")
    rows = {row.name: row for row in Schedule.objects.all()}
    assert set(rows) == {"mine", "ping"} and rows["ping"].every == 45.0
    settings.LEASES_SCHEDULES = {"ping": {"handler": "no.such.handler", "every": 45}}
    with pytest.raises(Exception, match="no handler named 'no.such.handler'"):
        call_command("leases_worker", "--queue", "default", "--burst")
    assert Schedule.objects.get(name="ping").every == 45.0  # nothing half-written


def test_a_worker_with_no_schedule_neither_applies_settings_nor_fires(settings):
    settings.LEASES_SCHEDULES = {"ping": {"handler": "sched.ping", "every": 1}}
    call_command("leases_worker", "--queue", "default", "--burst", "--no-schedule")
    assert not Schedule.objects.exists()


# -- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"handler": "sched.ping", "cron": "61 * * * *"}, "invalid cron expression '61 * * * *'"),
        ({"handler": "sched.ping", "cron": "* * *"}, "must have five fields"),
        ({"handler": "sched.ping"}, "give exactly one of cron, every and at (got none)"),
        ({"handler": "sched.ping", "every": 5, "cron": "* * * * *"}, "give exactly one of cron, every and at"),
        ({"handler": "sched.ping", "every": 0}, "every must be from 1 second"),
        ({"handler": "sched.ping", "every": -3}, "every must be from 1 second"),
        ({"handler": "sched.ping", "every": timedelta(0)}, "every must be from 1 second"),
        ({"handler": "sched.ping", "every": float("nan")}, "every must be a number of seconds"),
        ({"handler": "sched.ping", "at": datetime(2030, 1, 1)}, "must be an aware datetime"),
        ({"handler": "sched.ping", "at": utc(2001, 1, 1)}, "is in the past"),
        ({"handler": "sched.ping", "every": 5, "timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
        ({"handler": "sched.ping", "every": 5, "payload": {"x": float("nan")}}, "payload"),
        ({"handler": "sched.ping", "every": 5, "catch_up": "some"}, "catch_up must be"),
        ({"handler": "sched.ping", "every": 5, "queue": "nowhere"}, "nowhere"),
        ({"pipeline": "no-such-pipeline", "every": 5}, "no pipeline named 'no-such-pipeline'"),
        ({"every": 5}, "give a handler or a pipeline"),
        ({"handler": "sched.ping", "pipeline": "crawl-site", "every": 5}, "give a handler or a pipeline"),
        ({"handler": "sched.ping", "every": 5, "context": {}}, "takes payload, not context"),
    ],
)
def test_bad_schedules_are_refused_with_one_line_and_write_nothing(kwargs, message):
    schedule("existing", "sched.ping", every=60)
    before = list(Schedule.objects.values())
    with pytest.raises(ValueError, match=None) as info:
        schedule("new", **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert list(Schedule.objects.values()) == before


def test_an_unknown_handler_is_refused():
    with pytest.raises(UnknownHandler):
        schedule("x", "no.such.handler", every=5)
    assert not Schedule.objects.exists()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    cron=st.one_of(st.none(), st.text(max_size=30)),
    every=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**12)),
    timezone=st.one_of(st.none(), st.text(max_size=20), st.sampled_from(["UTC", BERLIN, "America/New_York"])),
)
def test_any_timing_is_either_sound_or_refused_with_one_line(cron, every, timezone):
    try:
        timing = check_timing(cron, every, None, timezone)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    after = timing.after(utc(2030, 1, 1))
    assert after is None or after > utc(2030, 1, 1)
    assert isinstance(timing.describe(), str)


def test_keys_of_settings_are_checked_before_anything_is_written(settings):
    settings.LEASES_SCHEDULES = {"ok": {"handler": "sched.ping", "every": 5}, "bad": {"handler": "sched.ping",
                                                                                       "evry": 5}}
    with pytest.raises(ValueError, match=r"LEASES_SCHEDULES\['bad'\]: unknown key\(s\) evry"):
        sched.apply_settings()
    assert not Schedule.objects.exists()


@pytest.mark.parametrize("seconds, words", [(1, "every 1s"), (30, "every 30s"), (90, "every 1m30s"),
                                             (3600, "every 1h"), (5400, "every 1h30m"), (86400, "every 1d"),
                                             (1.5, "every 1.5s")])
def test_an_interval_in_words(seconds, words):
    assert Timing(every=seconds).describe() == words


def test_a_pass_with_a_budget_stops_after_a_batch_and_says_more_is_due():
    now = db_now()
    Schedule.objects.bulk_create(
        Schedule(name=f"s{n}", handler="sched.ping", every=60.0, timezone="UTC", next_fire_at=now,
                 created_at=now, updated_at=now)
        for n in range(sched.BATCH * 2 + 10)
    )
    assert sched.fire_some(now=now, budget=0) == (sched.BATCH, True)
    assert sched.fire_some(now=now) == (sched.BATCH + 10, False)
    assert ScheduleRun.objects.count() == sched.BATCH * 2 + 10
