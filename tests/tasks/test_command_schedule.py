"""`manage.py schedule`: what operators type, what they read, and one-line errors (exit 2)
that write nothing."""
from __future__ import annotations

import io
import re
import subprocess

import pytest
from django.core.management import CommandError, call_command

import tests.jobs  # noqa: F401 - registers "noop"
import tests.pipes  # noqa: F401 - registers crawl-site
from leases.tasks import schedule
from leases.tasks.models import Job, Schedule, ScheduleRun
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("schedule", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def fails(*args: str) -> str:
    with pytest.raises(CommandError) as info:
        run(*args)
    assert info.value.returncode == 2 and "\n" not in str(info.value)
    return str(info.value)


def everything() -> list:
    return [list(model.objects.order_by("pk").values()) for model in (Schedule, ScheduleRun, Job)]


def test_add_list_show_a_cron_an_interval_a_one_off_and_a_pipeline():
    assert run("add", "nightly", "noop", "--cron", "0 3 * * *", "--timezone", "Europe/Berlin",
               "--payload", '{"site": "example.com"}').startswith(
        "schedule nightly: noop, At 03:00 every day (Europe/Berlin); next fire 20")
    run("add", "ping", "noop", "--every", "30s", "--priority", "5", "--catch-up", "none")
    run("add", "launch", "noop", "--at", "2099-01-01T09:00:00+01:00")
    run("add", "refresh", "--pipeline", "crawl-site", "--every", "15m", "--context", '{"items": 2}')
    rows = {row.name: row for row in Schedule.objects.all()}
    assert (rows["ping"].every, rows["ping"].priority, rows["ping"].catch_up) == (30.0, 5, "none")
    assert rows["launch"].next_fire_at.isoformat() == "2099-01-01T08:00:00+00:00"
    assert (rows["refresh"].pipeline, rows["refresh"].payload) == ("crawl-site", {"items": 2})
    out = run("list")
    header, *lines = out.splitlines()
    assert header.split() == ["NAME", "WHAT", "WHEN", "NEXT", "LAST", "STATUS", "ENABLED", "SOURCE"]
    assert [line.split()[0] for line in lines] == ["launch", "nightly", "ping", "refresh"]
    assert "pipeline crawl-site" in lines[3] and "every 15m" in lines[3]
    assert re.search(r"ping\s+noop\s+every 30s\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(in \d+s\)", out)
    shown = run("show", "nightly")
    assert re.search(r"^when +At 03:00 every day \(Europe/Berlin\)$", shown, re.M)
    assert re.search(r"^queue +default \(its handler's\)$", shown, re.M)
    assert '\npayload:\n  {\n    "site": "example.com"\n  }\n' in shown  # JSON, as `jobs show` prints it
    assert '\ncontext:\n  {\n    "items": 2\n  }\n' in run("show", "refresh")
    upcoming = re.findall(r"^  (\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ)", shown, re.M)
    assert len(upcoming) == 5 and all(t.endswith(("01:00:00Z", "02:00:00Z")) for t in upcoming)
    assert shown.rstrip().endswith("no runs yet")


def test_run_enable_disable_remove_and_show_the_runs():
    schedule("ping", "noop", every=60)
    assert run("run", "ping") == f"schedule ping: run #1 fired, job #{Job.objects.get().pk}\n"
    JobWorker(queues=["default"], burst=True, poll=0.01).run()
    shown = run("show", "ping")
    assert re.search(r"#1\s+by hand\s+\S+ \S+Z\s+#\d+\s+succeeded\s+\d+ms", shown)
    assert run("disable", "ping") == "schedule ping disabled\n"
    assert run("disable", "ping") == "schedule ping was disabled already\n"
    assert "no fire time ahead" in run("show", "ping")
    assert re.search(r"ping\s+noop\s+every 1m\s+-\s+-\s+succeeded\s+no\s+api", run("list"))
    assert run("enable", "ping") == "schedule ping enabled\n"
    assert run("remove", "ping") == "schedule ping removed\n"
    assert not Schedule.objects.exists() and not ScheduleRun.objects.exists()
    assert run("list") == "no schedules\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (("add", "x", "noop", "--cron", "61 * * * *"), "invalid cron expression '61 * * * *'"),
        (("add", "x", "noop"), "give exactly one of cron, every and at (got none)"),
        (("add", "x", "noop", "--every", "0s"), "--every: duration must be > 0"),
        (("add", "x", "noop", "--every", "soon"), "--every: not a duration: 'soon'"),
        (("add", "x", "noop", "--at", "2099-01-01T09:00:00"), "has no time zone"),
        (("add", "x", "noop", "--at", "tomorrow"), "--at must be an ISO 8601 time"),
        (("add", "x", "noop", "--at", "2001-01-01T00:00:00Z"), "is in the past"),
        (("add", "x", "noop", "--every", "5s", "--timezone", "Nowhere/Special"), "unknown time zone"),
        (("add", "x", "no.such", "--every", "5s"), "no handler named 'no.such'"),
        (("add", "x", "--pipeline", "nope", "--every", "5s"), "no pipeline named 'nope'"),
        (("add", "x", "noop", "--every", "5s", "--payload", "{oops"), "--payload is not valid JSON"),
        (("add", "x", "noop", "--every", "5s", "--priority", "high"), "--priority must be a whole number"),
        (("add", "x", "noop", "--every", "5s", "--catch-up", "most"), "catch_up must be"),
        (("run", "ghost"), "no schedule named 'ghost' (known: kept)"),
        (("show", "ghost"), "no schedule named 'ghost'"),
        (("enable", "ghost"), "no schedule named 'ghost'"),
        (("remove", "ghost"), "no schedule named 'ghost'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message):
    schedule("kept", "noop", every=60)
    before = everything()
    assert message in fails(*args)
    assert everything() == before


def test_a_schedule_from_settings_is_removed_in_settings_not_here(settings):
    settings.LEASES_SCHEDULES = {"ping": {"handler": "noop", "every": 60}}
    from leases.tasks.schedules import apply_settings

    apply_settings()
    assert "comes from settings.LEASES_SCHEDULES: remove it there" in fails("remove", "ping")
    assert Schedule.objects.filter(name="ping").exists()


def test_the_command_line(manage, child_env):
    result = subprocess.run([*manage, "schedule", "add", "x", "noop", "--import", "tests.jobs", "--cron", "* *"],
                            env=child_env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "CommandError: cron expression '* *' must have five fields: minute hour day month weekday"
    ]
    ok = subprocess.run([*manage, "schedule", "add", "x", "noop", "--import", "tests.jobs", "--every", "1h"],
                        env=child_env, capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith("schedule x: noop, every 1h; next fire ")
