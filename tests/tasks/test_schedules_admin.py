"""The schedules admin: what, when in words and the clock's view, the newest runs, a form
that checks what the API checks, settings rows read-only, and recorded actions."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import tests.jobs  # noqa: F401 - registers "noop"
from leases.clock import db_now
from leases.tasks import schedule
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.schedules import apply_settings, fire_now
from leases.tasks.worker import JobWorker
from tests.helpers import table

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

SCHEDULES = reverse("admin:leases_tasks_schedule_changelist")
ADD = reverse("admin:leases_tasks_schedule_add")


def page(row: Schedule) -> str:
    return reverse("admin:leases_tasks_schedule_change", args=[row.pk])


def form(**fields) -> dict:
    """The add/change form's POST data: a noop every minute unless told otherwise."""
    data = {"name": "ping", "handler": "noop", "pipeline": "", "cron": "", "every": "60", "at_0": "", "at_1": "",
            "timezone": "", "payload": "{}", "queue": "", "priority": "0", "enabled": "on", "catch_up": "last",
            "runs-TOTAL_FORMS": "0", "runs-INITIAL_FORMS": "0", "runs-MIN_NUM_FORMS": "0",
            "runs-MAX_NUM_FORMS": "1000"}
    data.update(fields)
    return {key: value for key, value in data.items() if value is not None}


def test_the_list_says_what_when_next_last_and_how_the_last_run_ended(admin_client):
    schedule("nightly", "noop", cron="0 3 * * *", timezone="Europe/Berlin")
    schedule("ping", "noop", every=30, enabled=False)
    fire_now("ping")
    JobWorker(queues=["default"], burst=True, poll=0.01).run()
    rows = table(admin_client.get(SCHEDULES), "name")
    assert rows["nightly"]["when"] == "At 03:00 every day (Europe/Berlin)"
    assert rows["nightly"]["next_fire"].startswith("in ") and rows["nightly"]["last_run"] == "-"
    assert (rows["ping"]["when"], rows["ping"]["next_fire"], rows["ping"]["last_run"]) == ("every 30s", "-", "succeeded")
    assert rows["ping"]["last_fire"] == "-"  # fired by hand: not a tick
    assert set(table(admin_client.get(SCHEDULES, {"last": "succeeded"}), "name")) == {"ping"}
    assert set(table(admin_client.get(SCHEDULES, {"enabled__exact": "1"}), "name")) == {"nightly"}


def test_the_list_queries_do_not_grow_with_schedules(admin_client):
    def cost(expected: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert len(table(admin_client.get(SCHEDULES), "name")) == expected
        return len(queries)

    schedule("s0", "noop", every=60)
    few = cost(1)
    for n in range(1, 15):
        schedule(f"s{n}", "noop", every=60)
        fire_now(f"s{n}")
    assert cost(15) == few


def test_a_schedule_made_in_the_admin_is_checked_like_the_api(admin_client):
    bad = admin_client.post(ADD, form(cron="61 * * * *", every=""))
    assert bad.status_code == 200 and "invalid cron expression &#x27;61 * * * *&#x27;" in bad.content.decode()
    assert "give exactly one of cron, every and at (got cron, every)" in admin_client.post(
        ADD, form(cron="* * * * *")).content.decode()
    assert "no handler named &#x27;nope&#x27;" in admin_client.post(ADD, form(handler="nope")).content.decode()
    assert not Schedule.objects.exists()
    assert admin_client.post(ADD, form(every="", cron="0 3 * * *", timezone="Europe/Berlin")).status_code == 302
    row = Schedule.objects.get()
    assert (row.cron, row.timezone, row.source) == ("0 3 * * *", "Europe/Berlin", "api")
    assert row.next_fire_at.hour in (1, 2)  # 03:00 in Berlin
    # Changed to every 5 minutes: the next tick is counted from the database clock.
    assert admin_client.post(page(row), form(name=None, every="300")).status_code == 302
    row.refresh_from_db()
    assert row.every == 300.0 and row.cron == "" and row.next_fire_at - db_now() <= timedelta(seconds=300)


def test_a_schedule_from_settings_is_read_only_here(admin_client, settings):
    settings.LEASES_SCHEDULES = {"ping": {"handler": "noop", "every": 30}}
    apply_settings()
    row = Schedule.objects.get()
    response = admin_client.get(page(row))
    assert not response.context["has_delete_permission"]
    assert "every" in response.context["adminform"].readonly_fields
    admin_client.post(page(row), form(name=None, every="5"))
    row.refresh_from_db()
    assert row.every == 30.0


def test_actions_enable_disable_and_run_now_through_the_engine_and_are_recorded(admin_client):
    schedule("a", "noop", every=60)
    schedule("b", "noop", every=60, enabled=False)
    rows = list(Schedule.objects.order_by("name"))

    def act(action: str) -> list[str]:
        response = admin_client.post(SCHEDULES, {"action": action, "_selected_action": [r.pk for r in rows]},
                                     follow=True)
        return [str(m) for m in response.context["messages"]]

    assert act("enable_selected") == ["Enable: 1 of 2 selected schedules. 1 already were."]
    assert set(Schedule.objects.values_list("enabled", flat=True)) == {True}
    assert act("run_selected") == ["Run: 2 of 2 selected schedules."]
    assert ScheduleRun.objects.count() == 2 and Job.objects.count() == 2
    assert act("disable_selected") == ["Disable: 2 of 2 selected schedules."]
    assert set(Schedule.objects.values_list("next_fire_at", flat=True)) == {None}
    history = list(LogEntry.objects.filter(object_id=str(rows[1].pk)).order_by("id").values_list("change_message",
                                                                                               flat=True))
    assert history == ["Enable from the admin.", "Run from the admin.", "Disable from the admin."]


def test_a_schedules_page_lists_its_runs_with_their_jobs(admin_client):
    row = schedule("ping", "noop", every=60)
    run = fire_now("ping")
    text = admin_client.get(page(row)).content.decode()
    assert reverse("admin:leases_tasks_job_change", args=[run.job_id]) in text
    assert "by hand" in text and "queued" in text
