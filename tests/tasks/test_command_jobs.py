"""`manage.py jobs`: what operators type and read, exit codes, one-line errors (exit 2)
that write nothing, reads whose query count does not grow with the table, and status
names in the ORM."""
from __future__ import annotations

import io
import re
import subprocess
import time
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.jobs  # noqa: F401 - registers noop, boom, refuse, sleepy, echo
from leases.clock import db_now
from leases.tasks import push, push_many, registry
from leases.tasks import queue as jobqueue
from leases.tasks.models import DispatchWorker, Job, JobError, PoolTask, Queue
from leases.tasks.worker import JobWorker
from tests.helpers import jobs_command as run
from tests.helpers import jobs_command_fails as fails

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

NAMES = "ready, running, succeeded, failed, dead, cancelled, blocked"


def work() -> None:
    JobWorker(queues=["default"], burst=True, poll=0.01).run()


def everything() -> list:
    return [list(model.objects.order_by("pk").values()) for model in (Job, JobError, Queue)]


def make(name: str = "noop", status: int = Job.READY, queue: str = "default", run_in: float = -10,
         finished_ago: float | None = None, **fields) -> Job:
    """A job row as the engine leaves it; times in seconds from the database clock."""
    now = db_now()
    ended = status in Job.FINISHED
    if finished_ago is None and ended:
        finished_ago = 5
    expires_in = fields.pop("expires_in", 30 if status == Job.RUNNING else None)
    return Job.objects.create(
        queue=queue, name=name, key=f"{name}-{Job.objects.count()}", run_at=now + timedelta(seconds=run_in),
        status=status, enqueued_at=now - timedelta(minutes=5), max_attempts=fields.pop("max_attempts", 3),
        started_at=now - timedelta(seconds=20) if status != Job.READY else None,
        finished_at=now - timedelta(seconds=finished_ago) if ended else None,
        expires_at=None if expires_in is None else now + timedelta(seconds=expires_in), **fields,
    )


def rows(out: str) -> dict[str, list[str]]:
    """A table's lines by their first cell, split on runs of two or more spaces."""
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in out.splitlines()[1:])}


# -- list, show, stats ------------------------------------------------------------------


def test_list_is_newest_first_with_statuses_as_the_admin_words_them():
    done = make(status=Job.SUCCEEDED, attempt=1, worker="w1", run_in=-100)
    later = make(run_in=7200)
    retrying = make("boom", attempt=1, run_in=3)
    lapsed = make("sleepy", Job.RUNNING, attempt=1, worker="w-gone", expires_in=-5, run_in=-100)
    blocked = make("limited", Job.BLOCKED, queue="other")
    out = run("list")
    assert out.splitlines()[0].split() == ["ID", "NAME", "QUEUE", "STATUS", "ATTEMPTS", "RUN", "AT", "WORKER",
                                           "FINISHED"]
    listed = rows(out)
    assert list(listed) == [str(job.pk) for job in (blocked, lapsed, retrying, later, done)]
    assert listed[str(done.pk)][1:5] == ["noop", "default", "succeeded", "1/3"]
    assert listed[str(done.pk)][5:7] == ["1m ago", "w1"] and listed[str(done.pk)][7].endswith("Z")
    assert listed[str(later.pk)][3:6] == ["ready", "0/3", "in 1h"]
    assert listed[str(retrying.pk)][3:6:2] in (["awaiting retry", "in 1s"], ["awaiting retry", "in 2s"])
    assert listed[str(lapsed.pk)][3:] == ["running, lease lapsed", "1/3", "1m ago", "w-gone", "-"]
    assert listed[str(blocked.pk)][2:4] == ["other", "blocked"]
    assert list(rows(run("list", "--status", "ready"))) == [str(retrying.pk), str(later.pk)]
    assert list(rows(run("list", "--queue", "other"))) == [str(blocked.pk)]
    assert list(rows(run("list", "--name", "noop", "--limit", "1"))) == [str(later.pk)]
    assert run("list", "--status", "dead") == "no jobs\n"


def test_show_prints_every_field_payload_result_and_each_attempts_error():
    job = push("boom", {"n": 7, "note": "caf\u00e9\u202e"}, limit_key="site:a", concurrency=2, rate="10/m")
    work()
    out = run("show", str(job.pk))
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.split("\npayload:")[0].splitlines())
    assert fields["job"] == f"#{job.pk}" and fields["name"] == "boom" and fields["queue"] == "default"
    assert [fields[key] for key in ("status", "attempts", "claims", "pushes")] == ["dead", "3/3", "3", "1"]
    assert (fields["limit key"], fields["concurrency"], fields["rate"]) == ("site:a", "2", "10/m")
    assert fields["key"] == job.key and fields["pending key"] == "-" and fields["expires"] == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(\d+s ago\)", fields["finished"])
    assert fields["worker"] == Job.objects.get(pk=job.pk).worker != "" and fields["duration"].endswith("ms")
    # The payload as JSON; the right-to-left override escaped, the accent kept:
    assert '\n  {\n    "n": 7,\n    "note": "caf\u00e9\\u202e"\n  }\nresult: -\n' in out
    errors = rows(out.split("errors (3):\n")[1])
    assert [cells[:3] for cells in errors.values()] == [[n, "builtins.RuntimeError", "boom 7"] for n in "123"]
    assert "traceback" not in out
    traced = run("show", str(job.pk), "--traceback")
    assert traced.count("traceback:\n  Traceback (most recent call last):") == 3
    assert "  RuntimeError: boom 7" in traced
    echo = push("echo", {"a": 1})
    JobWorker(queues=["other"], burst=True, poll=0.01).run()
    shown = run("show", str(echo.pk))
    assert '\nresult:\n  {\n    "echo": {\n      "a": 1\n    }\n  }\nno errors\n' in shown
    assert re.search(r"^status +succeeded$", shown, re.MULTILINE)


def test_stats_counts_per_queue():
    Queue.objects.create(name="idle", paused=True)
    for run_in in (-60, -10, 600):
        make(run_in=run_in)
    make("limited", Job.BLOCKED)
    make("sleepy", Job.RUNNING, attempt=1, worker="w")
    make(status=Job.SUCCEEDED, attempt=1)
    make(status=Job.SUCCEEDED, attempt=1, finished_ago=50)
    make(status=Job.SUCCEEDED, attempt=1, finished_ago=7200)  # before the hour
    make("refuse", Job.FAILED, attempt=1)
    make("boom", Job.DEAD, attempt=3)
    make(status=Job.CANCELLED)
    make("echo", queue="other", run_in=-7300)
    out = run("stats")
    # Each column one status, as `list --status` names it: READY leaves the blocked job out.
    assert out.splitlines()[0].split() == ["QUEUE", "READY", "BLOCKED", "RUNNING", "DUE", "OLDEST", "DUE",
                                           "SUCCEEDED/1H", "FAILED/1H", "DEAD/1H", "PAUSED"]
    assert rows(out) == {
        "default": ["default", "3", "1", "1", "2", "1m ago", "2", "1", "1", "no"],
        "idle": ["idle", "0", "0", "0", "0", "-", "0", "0", "0", "yes"],
        "other": ["other", "1", "0", "0", "1", "2h ago", "0", "0", "0", "no"],
    }
    assert list(rows(run("stats", "--queue", "other"))) == ["other"]
    # A queue named in settings.TASKS, with no row and no job yet:
    assert rows(run("stats", "--queue", "tasks"))["tasks"] == ["tasks", *"0000", "-", *"000", "no"]


ADVANCE = "leases.pipelines.advance"  # internal: a pipeline's bookkeeping, not an operator's work


def test_list_leaves_internal_jobs_out_unless_asked():
    assert ADVANCE in registry.internal_names()
    mine = make(run_in=600)
    event = make(ADVANCE, max_attempts=1000, run_in=-1)
    done = make(ADVANCE, Job.SUCCEEDED, attempt=1, max_attempts=1000)
    assert list(rows(run("list"))) == [str(mine.pk)]
    assert list(rows(run("list", "--internal"))) == [str(done.pk), str(event.pk)]
    assert rows(run("list", "--internal"))[str(event.pk)][1:5] == [ADVANCE, "default", "ready", "0/1000"]
    assert list(rows(run("list", "--all"))) == [str(done.pk), str(event.pk), str(mine.pk)]
    # Asked for by name, they are shown:
    assert list(rows(run("list", "--name", ADVANCE, "--status", "ready"))) == [str(event.pk)]
    assert run("list", "--status", "succeeded") == "no jobs but internal ones (--all shows them)\n"
    assert run("list", "--status", "dead") == "no jobs\n"
    assert "not allowed with argument" in fails("list", "--internal", "--all")


def test_stats_counts_internal_jobs_on_a_line_of_their_own():
    make(run_in=-30)
    make(status=Job.SUCCEEDED, attempt=1)
    make(ADVANCE, run_in=-90)
    make(ADVANCE, queue="other", run_in=-5)
    make(ADVANCE, Job.RUNNING, attempt=1, worker="w")
    make(ADVANCE, Job.SUCCEEDED, attempt=1)
    make(ADVANCE, Job.DEAD, attempt=1000)
    listed = rows(run("stats"))
    assert listed["default"] == ["default", "1", "0", "0", "1", "30s ago", "1", "0", "0", "no"]
    assert listed["other"] == ["other", "0", "0", "0", "0", "-", "0", "0", "0", "no"]
    assert listed["(internal)"] == ["(internal)", "2", "0", "1", "2", "1m ago", "1", "0", "1", "-"]
    assert list(listed) == ["default", "other", "(internal)"]
    only = rows(run("stats", "--queue", "other"))
    assert only["(internal)"][1:5] == ["1", "0", "0", "1"] and list(only) == ["other", "(internal)"]
    Job.objects.filter(name=ADVANCE).delete()
    assert "(internal)" not in rows(run("stats"))


def test_a_misspelt_name_names_the_handlers_there_are_and_no_internal_one():
    """`jobs list --name crawl.fecth` said "no jobs" where every other typo gets the known
    list; and that list named the pipelines' own start job."""
    make()
    message = fails("list", "--name", "noop.typo")
    assert message.startswith("no handler or job named 'noop.typo' (known handlers: ") and "noop" in message
    assert "leases.pipelines" not in message
    assert run("list", "--name", "sleepy") == "no jobs\n"  # a handler with no job now is no typo


def test_list_and_stats_queries_do_not_grow_with_jobs():
    def queries(*args: str) -> int:
        with CaptureQueriesContext(connection) as captured:
            run(*args)
        return len(captured)

    make()
    make(status=Job.SUCCEEDED)
    commands = [("list",), ("list", "--status", "ready", "--queue", "default"), ("stats",)]
    few = [queries(*args) for args in commands]
    for index in range(60):
        make(queue=f"q{index % 3}", status=index % 7)
    assert [queries(*args) for args in commands] == few
    # Plus what leases.db reads unseen: the database clock each, the queues' settings for stats.
    assert few == [1, 1, 4]  # stats: by queue (3), the durable jobs suspended (1)
    with CaptureQueriesContext(connection) as captured:
        run("list", "--status", "failed")
    select = captured[-1]["sql"]
    assert "ORDER BY" in select and "LIMIT 50" in select and "COUNT" not in select.upper()


def test_stats_reads_no_finished_job_but_those_of_the_last_hour():
    # Made finished rather than updated: InnoDB counts an index entry an update left behind
    # until it is purged, and the planner would take the claim index for all but empty.
    day = db_now() - timedelta(days=1)
    Job.objects.bulk_create(
        Job(queue="default", name="noop", key=str(i), run_at=day, status=Job.SUCCEEDED, enqueued_at=day,
            started_at=day, finished_at=day, attempt=1)
        for i in range(3000)
    )
    push_many([("noop", {"n": i}) for i in range(20)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_tasks_job" if connection.vendor == "mysql" else "ANALYZE")
        if cursor.description:  # MySQL answers with a table of its own
            cursor.fetchall()
    with CaptureQueriesContext(connection) as captured:
        run("stats")
    vendor = connection.vendor
    plans = []
    with connection.cursor() as cursor:
        for query in (q["sql"] for q in captured if "leases_tasks_job" in q["sql"]):
            cursor.execute(("EXPLAIN QUERY PLAN " if vendor == "sqlite" else "EXPLAIN ") + query)
            names = [column[0] for column in cursor.description]
            plans.append([dict(zip(names, row)) for row in cursor.fetchall()])
    assert len(plans) == 4  # by queue (3) and the durable jobs suspended
    for plan in plans:  # a search or range of an index, never a walk of the table or a whole index
        if vendor == "mysql":  # the jobs not finished are read a status at a time, in one UNION ALL
            steps = [step for step in plan if not str(step["table"]).startswith("<union")]
            assert {step["type"] for step in steps} <= {"range", "ref"} and len(steps) in (1, 3), plan
        elif vendor == "postgresql":
            assert not any("Seq Scan on leases_tasks_job" in step["QUERY PLAN"] for step in plan), plan
        else:
            assert not any(step["detail"].startswith("SCAN leases_tasks_job") for step in plan), plan


# -- retry, cancel, discard -------------------------------------------------------------


def test_retry_cancel_and_discard_by_id_say_what_they_left_alone():
    failed = make("refuse", Job.FAILED, attempt=1)
    dead = make("boom", Job.DEAD, attempt=3)
    done = make(status=Job.SUCCEEDED, attempt=1)
    running = make("sleepy", Job.RUNNING, attempt=1)
    waiting = make(run_in=600)
    # A job named by id and left alone is exit 1, naming it: a script must see nothing happened.
    assert fails("retry", str(failed.pk), str(dead.pk), str(done.pk), str(failed.pk), code=1) == (
        f"retried 2 of 3: 1 not failed, dead or cancelled (#{done.pk} is succeeded)"
    )
    assert {Job.objects.get(pk=failed.pk).status, Job.objects.get(pk=dead.pk).status} == {Job.READY}
    # A running job named by id is asked to stop (its worker ends it cancelled); an ended one is news.
    assert run("cancel", str(running.pk)) == "cancelled 1 of 1 (1 running: asked to stop)\n"
    assert Job.objects.get(pk=running.pk).cancel_requested_at is not None
    assert fails("cancel", str(done.pk), code=1) == f"cancelled 0 of 1: 1 ended already (#{done.pk} is succeeded)"
    assert run("cancel", str(waiting.pk)) == "cancelled 1 of 1\n"
    assert Job.objects.get(pk=waiting.pk).status == Job.CANCELLED
    JobError.objects.create(job=dead, attempt=1, exception="x.Y", message="m", at=db_now())
    assert fails("discard", str(dead.pk), str(running.pk), code=1) == (
        f"discarded 1 of 2: 1 running (#{running.pk} is running)")
    assert not Job.objects.filter(pk=dead.pk).exists() and not JobError.objects.exists()
    quiet = io.StringIO()
    call_command("jobs", "retry", str(waiting.pk), verbosity=0, stdout=quiet)
    assert quiet.getvalue() == "" and Job.objects.get(pk=waiting.pk).status == Job.READY


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(action=st.sampled_from(["retry", "cancel", "discard"]), picks=st.lists(st.integers(0, 3), max_size=4),
       ghosts=st.lists(st.integers(10**12, 2**63 - 1), min_size=1, max_size=12), first=st.booleans())
def test_an_id_that_names_no_job_is_bad_input_and_changes_nothing(action, picks, ghosts, first):
    """Every id is checked before anything is done: `retry 99999` is a typo, not "0 of 1"."""
    if not Job.objects.exists():
        for status in (Job.FAILED, Job.READY, Job.CANCELLED, Job.DEAD):  # each action would change some
            make(status=status, attempt=1)
    jobs = [str(pk) for pk in Job.objects.order_by("pk").values_list("pk", flat=True)]
    known = [jobs[index] for index in picks]
    missing = list(dict.fromkeys(str(ghost) for ghost in ghosts))
    before = everything()
    message = fails(action, *(missing + known if first else known + missing))
    listed = ", ".join(f"#{ghost}" for ghost in missing[:10])
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    verb = {"retry": "retried", "cancel": "cancelled", "discard": "discarded"}[action]
    assert message == f"no job {listed}{more}: nothing {verb}"
    assert everything() == before


def test_the_status_forms_work_through_every_batch():
    push_many([("noop", {"n": i}, {"delay": 600}) for i in range(1203)])
    push("echo", {}, delay=600)
    assert run("cancel", "--queue", "default", "--status", "ready") == "cancelled 1203 of 1203\n"
    assert Job.objects.filter(status="ready").get().queue == "other"
    assert run("retry", "--status", "cancelled", "--queue", "other") == "retried 0 of 0\n"
    assert run("retry", "--status", "cancelled") == "retried 1203 of 1203\n"
    assert Job.objects.filter(status="ready").count() == 1204
    old = list(Job.objects.filter(queue="default").order_by("pk").values_list("pk", flat=True)[:700])
    Job.objects.filter(pk__in=old).update(enqueued_at=db_now() - timedelta(days=8))
    assert run("discard", "--status", "ready", "--older-than", "7d") == "discarded 700 of 700\n"
    assert run("discard", "--status", "ready", "--queue", "default") == "discarded 503 of 503\n"
    assert list(Job.objects.values_list("name", flat=True)) == ["echo"]


def test_a_batch_walk_takes_each_job_once_even_when_it_fails_again_at_once():
    failed = [make("refuse", Job.FAILED).pk for _ in range(5)]
    taken = []
    for batch in jobqueue.select_batches("failed", size=2):
        taken += batch
        jobqueue.retry(batch)
        Job.objects.filter(pk__in=batch).update(status="failed")  # as a fast worker would
    assert taken == failed


def test_discard_older_than_reads_finished_jobs_by_when_they_finished():
    fresh = make(status=Job.SUCCEEDED, finished_ago=60)
    make(status=Job.SUCCEEDED, finished_ago=3 * 3600)
    failed = make("refuse", Job.FAILED, finished_ago=3 * 3600)
    assert run("discard", "--status", "succeeded", "--older-than", "2h") == "discarded 1 of 1\n"
    assert set(Job.objects.values_list("pk", flat=True)) == {fresh.pk, failed.pk}


# -- wait -------------------------------------------------------------------------------


def _work_later() -> None:
    time.sleep(1)
    work()


def test_wait_exits_0_when_the_job_succeeds_meanwhile(processes):
    job = push("sleepy", {"seconds": 0.2})
    processes.start(_work_later)
    started = time.monotonic()
    assert run("wait", str(job.pk)) == f"job #{job.pk} succeeded\n"
    assert 0.9 < time.monotonic() - started < 20
    processes.join_all()


def test_wait_exits_1_with_the_last_error_and_75_on_timeout():
    dead = push("boom", {"n": 3})
    refused = push("refuse", {})
    work()
    assert fails("wait", str(dead.pk), code=1) == (
        f"job #{dead.pk} dead: builtins.RuntimeError: boom 3 (attempt 3)"
    )
    assert fails("wait", str(refused.pk), code=1) == (
        f"job #{refused.pk} failed: leases.exceptions.Fail: bad payload (attempt 1)"
    )
    cancelled = make(status=Job.CANCELLED)
    assert fails("wait", str(cancelled.pk), code=1) == f"job #{cancelled.pk} cancelled"
    later = make(run_in=600)
    started = time.monotonic()
    assert fails("wait", str(later.pk), "--timeout", "0.6s", code=75) == (
        f"job #{later.pk} is still ready after 0.6s"
    )
    assert 0.6 <= time.monotonic() - started < 5


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (("list", "--status", "broken"), f"--status must be one of {NAMES}, not 'broken'"),
        (("list", "--status", "Failed"), "--status must be one of"),
        (("list", "--limit", "0"), "--limit must be a whole number from 1 to 10000, not '0'"),
        (("list", "--limit", "lots"), "--limit must be a whole number"),
        (("list", "--limit", "10001"), "--limit must be a whole number"),
        (("show", "abc"), "a job id is a whole number from 1 to 9223372036854775807, not 'abc'"),
        (("show", "-3"), "a job id is a whole number"),
        (("show", "99999"), "no job #99999"),
        (("stats", "--queue", "ghost"), "no queue named 'ghost' (known: "),
        (("retry", "KEEP", "1.5"), "a job id is a whole number from 1 to 9223372036854775807, not '1.5'"),
        (("retry", "KEEP", "\u0661"), "not '\u0661'"),
        (("retry", "99999999999999999999"), "a job id is a whole number"),
        (("retry",), "retry: give job ids, or --status (failed or dead or cancelled)"),
        (("retry", "KEEP", "--status", "failed"), "retry: give job ids or --status, not both"),
        (("retry", "--status", "ready"), "retry --status must be failed or dead or cancelled, not 'ready'"),
        (("retry", "--status", "nope"), f"--status must be one of {NAMES}, not 'nope'"),
        (("cancel", "--status", "ready"), "cancel --status needs --queue"),
        (("cancel", "--status", "failed", "--queue", "default"), "cancel --status must be ready or blocked"),
        (("discard", "--status", "running"), "discard --status must be ready or succeeded or failed"),
        (("discard", "KEEP", "--older-than", "1d"), "discard: give job ids or --status, not both"),
        (("discard", "--status", "ready", "--older-than", "soon"), "--older-than: not a duration: 'soon'"),
        (("discard", "--status", "ready", "--older-than", "0d"), "--older-than: duration must be > 0"),
        (("discard", "--status", "ready", "--older-than", "7"), "--older-than: '7' needs a unit: 7s, 7m, 7h"),
        (("wait", "x1"), "a job id is a whole number"),
        (("wait", "KEEP", "--timeout", "-1"), "--timeout: duration must be > 0"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, message):
    kept = make(status=Job.CANCELLED)
    make(run_in=600)
    before = everything()
    assert message in fails(*[str(kept.pk) if arg == "KEEP" else arg for arg in args])
    assert everything() == before


def test_the_command_line(manage, child_env):
    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [*manage, "jobs", *args]
        return subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=60, check=False)

    job = make(run_in=600)
    bad = cli("retry", str(job.pk), "12x")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "CommandError: a job id is a whole number from 1 to 9223372036854775807, not '12x'"
    ]
    waited = cli("wait", str(job.pk), "--timeout", "0.5")
    assert waited.returncode == 75
    assert waited.stderr == f"CommandError: job #{job.pk} is still ready after 0.5s\n"
    assert (cli("cancel", str(job.pk)).returncode, Job.objects.get(pk=job.pk).status) == (0, Job.CANCELLED)
    listed = cli("list")
    assert listed.returncode == 0 and rows(listed.stdout)[str(job.pk)][3] == "cancelled"


# -- status names in the ORM ------------------------------------------------------------


def test_status_names_work_in_orm_lookups_and_numbers_still_do():
    ready, blocked = make(), make("limited", Job.BLOCKED)
    failed, dead = make("refuse", Job.FAILED), make("boom", Job.DEAD)

    def pks(**lookup) -> set[int]:
        return set(Job.objects.filter(**lookup).values_list("pk", flat=True))

    assert pks(status="failed") == pks(status=Job.FAILED) == pks(status="3") == {failed.pk}
    assert pks(status__in=["ready", "blocked"]) == pks(status__in=Job.WAITING) == {ready.pk, blocked.pk}
    assert pks(status__in=["dead", Job.FAILED]) == {failed.pk, dead.pk}
    others = {blocked.pk, failed.pk, dead.pk}
    assert set(Job.objects.exclude(status="ready").values_list("pk", flat=True)) == others
    statuses = Job.objects.order_by("pk").values_list("status", flat=True)
    assert list(statuses) == [Job.READY, Job.BLOCKED, Job.FAILED, Job.DEAD]
    assert Job.objects.filter(pk=ready.pk).update(status="cancelled") == 1
    assert Job.objects.get(pk=ready.pk).status == Job.CANCELLED
    with pytest.raises(ValueError, match=f"unknown job status 'finished': use one of {NAMES}"):
        list(Job.objects.filter(status="finished"))


def test_the_admins_status_filter_still_takes_numbers():
    make("refuse", Job.FAILED)
    dead = make("boom", Job.DEAD)
    request = RequestFactory().get("/", {"status__exact": str(Job.DEAD)})
    request.user = User.objects.create_superuser("root", "root@example.com", None)
    changelist = admin.site.get_model_admin(Job).get_changelist_instance(request)
    assert list(changelist.get_queryset(request).values_list("pk", flat=True)) == [dead.pk]


def test_the_dispatcher_models_read_as_the_dispatchers_in_the_admin():
    assert PoolTask._meta.verbose_name == "dispatcher task"
    assert DispatchWorker._meta.verbose_name == "dispatcher worker"
