"""The job queue admin: jobs, queues and queue workers by the database clock, engine-backed
actions, read-only engine state, and pages whose query count does not grow with rows."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import leases.ops.adminkit
import leases.ops.masking
import leases.tasks.admin.jobs
import tests.jobs  # noqa: F401 - registers the handlers the name filter offers
from leases.clock import db_now
from leases.tasks import queue as jobqueue
from leases.tasks.admin.jobs import JobAdmin
from leases.tasks.models import Job, JobError, Queue, Worker
from tests.helpers import table

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

JOBS = reverse("admin:leases_tasks_job_changelist")
QUEUES = reverse("admin:leases_tasks_queue_changelist")
WORKERS = reverse("admin:leases_tasks_worker_changelist")


def make(name: str, status: int = Job.READY, queue: str = "default", run_in: float = -12, **fields) -> Job:
    """A job row as the engine leaves it; times are seconds from the database clock."""
    now = db_now()
    finished = status in Job.FINISHED
    expires_in = fields.pop("expires_in", 30 if status == Job.RUNNING else None)
    return Job.objects.create(
        queue=queue, name=name, key=f"{name}-{Job.objects.count()}", priority=fields.pop("priority", 0),
        run_at=now + timedelta(seconds=run_in), status=status, enqueued_at=now - timedelta(minutes=5),
        started_at=now if status != Job.READY else None, finished_at=now if finished else None,
        expires_at=None if expires_in is None else now + timedelta(seconds=expires_in),
        max_attempts=fields.pop("max_attempts", 3), **fields,
    )


def error(job: Job, attempt: int, message: str) -> JobError:
    return JobError.objects.create(
        job=job, attempt=attempt, exception="builtins.RuntimeError", message=message,
        traceback=f"Traceback ...\nRuntimeError: {message}", worker="w", at=db_now(),
    )


def worker(name: str, expires_in: float, holder: str = "h", beat_ago: float = 5) -> Worker:
    now = db_now()
    return Worker.objects.create(
        name=name, holder=holder, queues="default,other", concurrency=4, started_at=now - timedelta(hours=1),
        heartbeat_at=now - timedelta(seconds=beat_ago), expires_at=now + timedelta(seconds=expires_in),
    )


@pytest.fixture
def jobs() -> dict[str, Job]:
    """One job per situation in queue default, two in other; queues default, other, idle."""
    for name in ("default", "other", "idle"):
        Queue.objects.create(name=name)
    made = {
        "due": make("noop", payload={"n": 1, "password": "hunter2"}),
        "later": make("noop", run_in=90),
        "retrying": make("boom", attempt=1),
        "running": make("sleepy", Job.RUNNING, attempt=1, worker="w-alive"),
        "orphan": make("sleepy", Job.RUNNING, attempt=1, worker="w-lapsed", expires_in=-5),
        "succeeded": make("echo", Job.SUCCEEDED, attempt=1, result={"echo": 1}),
        "failed": make("refuse", Job.FAILED, attempt=1, max_attempts=5),
        "dead": make("boom", Job.DEAD, attempt=3),
        "cancelled": make("noop", Job.CANCELLED),
        "other_due": make("echo", queue="other", run_in=-3600),
        "other_running": make("echo", Job.RUNNING, queue="other", attempt=1, worker="w-alive"),
    }
    error(made["failed"], 1, "bad payload")
    for attempt in (1, 2, 3):
        error(made["dead"], attempt, f"boom {attempt}")
    return made


def ids(response) -> set[int]:
    return {int(key) for key in table(response, "id")}


def act(client, url: str, action: str, pks) -> list[str]:
    response = client.post(url, {"action": action, "_selected_action": list(pks)}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


# -- jobs -------------------------------------------------------------------------------


def test_job_list_shows_status_attempts_and_times_by_the_database_clock(admin_client, jobs):
    rows = table(admin_client.get(JOBS), "id")
    row = {name: rows[str(job.pk)] for name, job in jobs.items()}
    assert list(rows) == [str(job.pk) for job in sorted(jobs.values(), key=lambda j: -j.pk)]  # newest first
    assert {name: r["status_text"] for name, r in row.items()} == {
        "due": "ready", "later": "ready", "retrying": "awaiting retry", "running": "running",
        "orphan": "running, lease lapsed", "succeeded": "succeeded", "failed": "failed", "dead": "dead",
        "cancelled": "cancelled", "other_due": "ready", "other_running": "running",
    }
    assert row["due"]["when"] in ("12s ago", "13s ago")  # one time column: due, running for, ended
    assert row["later"]["when"] in ("in 1m", "in 89s")
    assert row["other_due"]["when"] == "1h ago"
    assert row["failed"]["attempts"] == "1/5" and row["due"]["attempts"] == "0/3"
    assert row["running"]["worker_short"] == "w-alive" and row["running"]["queue"] == "default"
    assert row["dead"]["when"].startswith(("0s ago, took", "1s ago, took"))
    assert row["due"]["when.title"].startswith("due ") and "lease until" in row["running"]["when.title"]
    assert row["running"]["when"].startswith("for ") and row["orphan"]["when"].startswith("for ")
    assert row["succeeded"]["when"] in ("0s ago, took 0ms", "1s ago, took 0ms")


def test_worker_column_shows_host_and_pid_with_the_whole_name_on_hover(admin_client, jobs):
    make("sleepy", Job.RUNNING, attempt=1, worker="crawl-7:4242:9f3a1c")
    page = admin_client.get(JOBS).content.decode()
    assert 'title="crawl-7:4242:9f3a1c">crawl-7:4242</span>' in page


def test_lease_filter_finds_running_jobs_whose_worker_is_gone(admin_client, jobs):
    assert ids(admin_client.get(JOBS, {"lease": "lapsed"})) == {jobs["orphan"].pk}
    assert ids(admin_client.get(JOBS, {"lease": "live"})) == {jobs["running"].pk, jobs["other_running"].pk}


def test_search_finds_a_job_by_id_or_names_and_keys_by_prefix(admin_client, jobs):
    assert ids(admin_client.get(JOBS, {"q": str(jobs["dead"].pk)})) == {jobs["dead"].pk}
    assert ids(admin_client.get(JOBS, {"q": f"#{jobs['dead'].pk}"})) == {jobs["dead"].pk}
    assert ids(admin_client.get(JOBS, {"q": "slee"})) == {jobs["running"].pk, jobs["orphan"].pk}
    assert ids(admin_client.get(JOBS, {"q": "leepy"})) == set()  # a prefix, so an index can serve it
    assert ids(admin_client.get(JOBS, {"q": jobs["failed"].key})) == {jobs["failed"].pk}


def test_name_filter_offers_names_of_recent_jobs_not_only_registered_handlers(admin_client, jobs):
    make("made.elsewhere", Job.SUCCEEDED, attempt=1)
    page = admin_client.get(JOBS).content.decode()
    assert "?name=made.elsewhere" in page and "?name=noop" in page


def test_job_run_times_are_judged_by_the_database_clock(admin_client, jobs, monkeypatch):
    real, reads = leases.ops.adminkit.db_now, []
    monkeypatch.setattr(leases.ops.adminkit, "db_now",
                        lambda using=None: reads.append(1) or real(using) + timedelta(days=2))
    rows = table(admin_client.get(JOBS), "id")
    assert rows[str(jobs["later"].pk)]["when"] == "1d ago"
    assert rows[str(jobs["running"].pk)]["status_text"] == "running, lease lapsed"
    assert len(reads) == 1


def test_job_filters_by_queue_status_and_name_without_scanning_jobs(admin_client, jobs):
    assert ids(admin_client.get(JOBS, {"queue": "other"})) == {jobs["other_due"].pk, jobs["other_running"].pk}
    running = admin_client.get(JOBS, {"status__exact": Job.RUNNING, "queue": "default"})
    assert ids(running) == {jobs["running"].pk, jobs["orphan"].pk}
    assert ids(admin_client.get(JOBS, {"name": "boom"})) == {jobs["retrying"].pk, jobs["dead"].pk}
    assert ids(admin_client.get(JOBS, {"name": "boom", "status__exact": Job.DEAD})) == {jobs["dead"].pk}

    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(JOBS).content.decode()
    for offered in ("?queue=idle", "?name=refuse", f"?status__exact={Job.CANCELLED}"):
        assert offered in page
    sql = [q["sql"].upper() for q in queries]
    assert not any("DISTINCT" in q for q in sql)
    counts = [q for q in sql if "COUNT(" in q]
    assert counts and all("LIMIT" in q for q in counts)  # no unbounded COUNT over the jobs


def test_job_count_stops_at_its_limit(admin_client, jobs, monkeypatch):
    monkeypatch.setattr(JobAdmin, "count_limit", 4)
    monkeypatch.setattr(JobAdmin, "list_per_page", 3)
    page = admin_client.get(JOBS)
    assert "4+ jobs" in page.content.decode()
    assert len(ids(page)) == 3
    assert len(ids(admin_client.get(JOBS, {"p": 2}))) == 1  # the pages hold the first `limit` rows
    small = admin_client.get(JOBS, {"queue": "other"}).content.decode()
    assert "2 jobs" in small and "2+" not in small


def test_job_list_queries_do_not_grow_with_jobs(admin_client, jobs):
    def page() -> int:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(JOBS)
        assert len(ids(response)) == Job.objects.count()
        return len(queries)

    few = page()
    for n in range(20):
        make("noop", Job.SUCCEEDED if n % 2 else Job.RUNNING, attempt=1, worker=f"w{n}")
    assert page() == few


def test_job_page_shows_payload_result_and_errors_read_only(admin_client, jobs):
    dead = admin_client.get(change_url(jobs["dead"]))
    assert dead.status_code == 200 and not dead.context["has_change_permission"]
    assert not dead.context["adminform"].form.fields
    html = dead.content.decode()
    for attempt in (1, 2, 3):
        assert f"boom {attempt}" in html and f"RuntimeError: boom {attempt}" in html
    assert "builtins.RuntimeError" in html
    (errors,) = dead.context["inline_admin_formsets"]
    assert not (errors.has_add_permission or errors.has_change_permission or errors.has_delete_permission)
    assert 'name="_save"' not in html

    done = admin_client.get(change_url(jobs["succeeded"])).content.decode()
    assert "&quot;echo&quot;: 1" in done
    due = admin_client.get(change_url(jobs["due"])).content.decode()
    assert "hunter2" in due  # those who may act on jobs see the payload as stored


def test_the_admins_times_read_as_the_commands_say_them(admin_client, jobs):
    """A job's page showed its run time as "2026-11-26 05:09:15" and its errors' as "Nov. 26,
    2026, 5:09 a.m.", the commands "2026-11-26 05:09:15Z": one way everywhere."""
    worker("w-alive", 30)
    moment = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"
    for url in (change_url(jobs["dead"]), reverse("admin:leases_tasks_worker_change", args=[Worker.objects.get().pk])):
        html = admin_client.get(url).content.decode()
        assert not re.search(r"a\.m\.|p\.m\.|noon|midnight", html), url
        assert len(re.findall(moment, html)) >= 3, url


def test_jobs_cannot_be_added_edited_or_deleted_and_viewers_get_no_actions(client, admin_client, jobs):
    pk = jobs["due"].pk
    assert admin_client.get(reverse("admin:leases_tasks_job_add")).status_code == 403
    assert admin_client.post(reverse("admin:leases_tasks_job_delete", args=[pk])).status_code == 403
    change = reverse("admin:leases_tasks_job_change", args=[pk])
    assert admin_client.post(change, {"priority": 50, "status": Job.DEAD}).status_code == 403
    assert Job.objects.filter(pk=pk, priority=0, status=Job.READY).exists()
    actions = dict(admin_client.get(JOBS).context["action_form"].fields["action"].choices)
    assert set(actions) - {""} == {"retry_selected", "cancel_selected", "discard_selected", "recover_selected",
                                     "send_event_selected"}

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(*Permission.objects.filter(codename__in=["view_job", "view_joberror"]))
    client.force_login(viewer)
    assert client.get(JOBS).context["action_form"] is None
    assert act(client, JOBS, "cancel_selected", [pk]) == []
    assert Job.objects.get(pk=pk).status == Job.READY
    page = client.get(change).content.decode()
    assert "hunter2" not in page and leases.ops.masking.MASK in page


@pytest.fixture
def secret_job() -> Job:
    """A failed job whose result, error message and traceback each hold a credential."""
    job = make("refuse", Job.FAILED, attempt=1, result={"token": "tok-1", "proxy": "http://u:pw-2@proxy:3128"})
    JobError.objects.create(
        job=job, attempt=1, exception="builtins.RuntimeError", worker="w", at=db_now(),
        message="refused by https://api/v1?api_key=key-3&page=2",
        traceback="Traceback ...\nRuntimeError: sent Authorization: Bearer tok-4",
    )
    return job


def job_page(client, permissions: list[str], job: Job) -> str:
    user = User.objects.create_user("-".join(permissions), password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=permissions))
    client.force_login(user)
    response = client.get(change_url(job))
    assert response.status_code == 200
    return response.content.decode()


def test_viewers_see_result_errors_and_tracebacks_masked(client, secret_job):
    page = job_page(client, ["view_job", "view_joberror"], secret_job)
    for secret in ("tok-1", "pw-2", "key-3", "tok-4"):
        assert secret not in page
    mask = leases.ops.masking.MASK
    assert f"&quot;token&quot;: &quot;{mask}&quot;" in page
    assert f"http://u:{mask}@proxy:3128" in page
    assert f"refused by https://api/v1?api_key={mask}&amp;page=2" in page
    assert f"RuntimeError: sent Authorization: {mask}" in page


def test_who_may_change_jobs_sees_result_errors_and_tracebacks_as_stored(client, secret_job):
    page = job_page(client, ["view_job", "change_job", "view_joberror"], secret_job)
    assert "&quot;token&quot;: &quot;tok-1&quot;" in page and "http://u:pw-2@proxy:3128" in page
    assert "refused by https://api/v1?api_key=key-3&amp;page=2" in page
    assert "RuntimeError: sent Authorization: Bearer tok-4" in page
    assert leases.ops.masking.MASK not in page


def change_url(obj) -> str:
    return reverse(f"admin:leases_tasks_{obj._meta.model_name}_change", args=[obj.pk])


def statuses(jobs: dict[str, Job]) -> dict[str, int]:
    found = dict(Job.objects.values_list("pk", "status"))
    return {name: found.get(job.pk) for name, job in jobs.items()}


def test_cancel_stops_waiting_jobs_asks_running_ones_to_stop_and_leaves_finished_ones(admin_client, jobs):
    before = statuses(jobs)
    chosen = ("due", "retrying", "running", "succeeded")
    assert act(admin_client, JOBS, "cancel_selected", [jobs[n].pk for n in chosen]) == [
        "Cancelled 3 of 4 selected jobs. 1 running: asked to stop at their worker's next heartbeat."
        " 1 ended already."
    ]
    assert statuses(jobs) == {**before, "due": Job.CANCELLED, "retrying": Job.CANCELLED}
    assert Job.objects.get(pk=jobs["due"].pk).finished_at is not None
    from django.contrib.admin.models import LogEntry

    running = Job.objects.get(pk=jobs["running"].pk)
    assert running.cancel_requested_at is not None  # its worker ends it, cancelled
    assert LogEntry.objects.get(object_id=str(running.pk)).change_message == (
        "Cancelled from the admin (running: asked to stop).")


def test_retry_gives_failed_dead_and_cancelled_jobs_another_attempt(admin_client, jobs):
    before = statuses(jobs)
    chosen = ("failed", "dead", "cancelled", "succeeded", "running")
    assert act(admin_client, JOBS, "retry_selected", [jobs[n].pk for n in chosen]) == [
        "Retried 3 of 5 selected jobs. 2 not failed, dead or cancelled."
    ]
    assert statuses(jobs) == {**before, "failed": Job.READY, "dead": Job.READY, "cancelled": Job.READY}
    dead = Job.objects.get(pk=jobs["dead"].pk)
    assert (dead.attempt, dead.max_attempts, dead.finished_at) == (3, 4, None)
    rows = table(admin_client.get(JOBS), "id")
    assert rows[str(dead.pk)]["status_text"] == "awaiting retry"
    assert rows[str(jobs["cancelled"].pk)]["status_text"] == "ready"


def test_discard_deletes_jobs_and_errors_but_not_running_jobs(admin_client, jobs):
    chosen = ("dead", "running", "due")
    assert act(admin_client, JOBS, "discard_selected", [jobs[n].pk for n in chosen]) == [
        "Discarded 2 of 3 selected jobs. 1 running."
    ]
    left = set(Job.objects.values_list("pk", flat=True))
    assert left == {job.pk for name, job in jobs.items() if name not in ("dead", "due")}
    assert list(JobError.objects.values_list("job_id", flat=True)) == [jobs["failed"].pk]
    assert act(admin_client, JOBS, "discard_selected", [jobs["running"].pk]) == [
        "Discarded 0 of 1 selected job. 1 running."
    ]


def test_recover_puts_lapsed_jobs_back_and_leaves_live_ones(admin_client, jobs):
    before = statuses(jobs)
    chosen = ("orphan", "running", "due")
    assert act(admin_client, JOBS, "recover_selected", [jobs[n].pk for n in chosen]) == [
        "Recovered 1 of 3 selected jobs. 2 not running with a lapsed lease."
    ]
    assert statuses(jobs) == {**before, "orphan": Job.READY}
    orphan = Job.objects.get(pk=jobs["orphan"].pk)
    assert orphan.worker == "" and orphan.expires_at is None
    (lost,) = JobError.objects.filter(job=orphan)
    assert "admin" in lost.message and lost.exception.endswith("WorkerLost")
    assert act(admin_client, JOBS, "cancel_selected", [orphan.pk]) == ["Cancelled 1 of 1 selected job."]


def test_lapsed_job_page_says_what_happens_next(admin_client, jobs):
    assert "stopped heartbeating" in admin_client.get(change_url(jobs["orphan"])).content.decode()
    assert "stopped heartbeating" not in admin_client.get(change_url(jobs["running"])).content.decode()


def test_job_actions_are_recorded_in_each_jobs_history(admin_client, jobs):
    from django.contrib.admin.models import LogEntry

    act(admin_client, JOBS, "cancel_selected", [jobs["due"].pk, jobs["succeeded"].pk])
    act(admin_client, JOBS, "recover_selected", [jobs["orphan"].pk])
    logged = {(int(e.object_id), e.change_message) for e in LogEntry.objects.all()}
    assert logged == {(jobs["due"].pk, "Cancelled from the admin."),
                      (jobs["orphan"].pk, "Recovered from the admin (its worker had stopped heartbeating).")}
    history = admin_client.get(reverse("admin:leases_tasks_job_history", args=[jobs["due"].pk]))
    assert "Cancelled from the admin." in history.content.decode()


def test_actions_on_all_filtered_jobs_call_the_engine_in_batches(admin_client, monkeypatch):
    monkeypatch.setattr(leases.tasks.admin.jobs, "ACTION_BATCH", 2)
    waiting = [jobqueue.push("noop", {"n": n}).pk for n in range(5)]
    elsewhere = jobqueue.push("echo", {"n": 0}).pk  # queue "other"
    response = admin_client.post(
        f"{JOBS}?queue=default",
        {"action": "cancel_selected", "select_across": "1", "_selected_action": [waiting[0]]},
        follow=True,
    )
    assert [str(m) for m in response.context["messages"]] == ["Cancelled 5 of 5 selected jobs."]
    assert set(Job.objects.filter(status=Job.CANCELLED).values_list("pk", flat=True)) == set(waiting)
    assert Job.objects.get(pk=elsewhere).status == Job.READY


def test_actions_work_on_pushed_jobs(admin_client):
    pushed = [jobqueue.push("noop", {"n": n}) for n in range(3)]
    assert act(admin_client, JOBS, "cancel_selected", [job.pk for job in pushed[:2]]) == [
        "Cancelled 2 of 2 selected jobs."
    ]
    assert act(admin_client, JOBS, "retry_selected", [pushed[0].pk]) == ["Retried 1 of 1 selected job."]
    assert dict(Job.objects.values_list("pk", "status")) == {
        pushed[0].pk: Job.READY, pushed[1].pk: Job.CANCELLED, pushed[2].pk: Job.READY
    }


# -- queues -----------------------------------------------------------------------------


def test_queue_list_shows_backlog_and_settings(admin_client, jobs):
    Queue.objects.filter(name="other").update(paused=True, max_length=500, when_full=Queue.WAIT)
    rows = table(admin_client.get(QUEUES), "name")
    assert {name: (r["waiting"], r["running"]) for name, r in rows.items()} == {
        "default": ("3", "2"), "idle": ("0", "0"), "other": ("1", "1"),
    }
    assert list(table(admin_client.get(QUEUES, {"paused__exact": "1"}), "name")) == ["other"]
    assert rows["default"]["oldest_due"] in ("12s ago", "13s ago")  # the retry is due too; "later" is not
    assert rows["other"]["oldest_due"] == "1h ago" and rows["idle"]["oldest_due"] == "-"
    assert rows["other"]["max_length"] == "500" and rows["other"]["when_full"].startswith("wait")
    assert rows["other"]["state"].endswith("paused") and rows["default"]["state"].endswith("active")
    page = admin_client.get(QUEUES).content.decode()
    assert f"?queue=other&amp;status__exact={Job.READY}" in page  # the counts link to the jobs


def test_queue_list_queries_do_not_grow_with_queues(admin_client, jobs):
    def page(expected: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert len(table(admin_client.get(QUEUES), "name")) == expected
        return len(queries)

    few = page(3)
    for n in range(10):
        Queue.objects.create(name=f"q{n}")
        make("noop", queue=f"q{n}")
        make("noop", Job.RUNNING, queue=f"q{n}", attempt=1, worker="w")
    assert page(13) == few
    assert table(admin_client.get(QUEUES), "name")["q7"]["waiting"] == "1"


def test_pause_and_resume_reach_the_settings_at_once(admin_client, jobs):
    def paused() -> dict[str, bool]:
        return dict(Queue.objects.values_list("name", "paused"))

    pks = dict(Queue.objects.values_list("name", "pk"))
    assert not jobqueue.queue_settings("default").paused  # now cached for a second
    assert act(admin_client, QUEUES, "pause_selected", [pks["default"], pks["idle"]]) == ["Paused 2 queues."]
    assert paused() == {"default": True, "idle": True, "other": False}
    assert jobqueue.queue_settings("default").paused
    assert act(admin_client, QUEUES, "pause_selected", [pks["default"]]) == ["Paused 0 queues."]
    resumed = act(admin_client, QUEUES, "resume_selected", [pks["default"], pks["other"]])
    assert resumed == ["Resumed 1 queue."]
    assert paused() == {"default": False, "idle": True, "other": False}
    assert not jobqueue.queue_settings("default").paused
    from django.contrib.admin.models import LogEntry

    assert sorted(LogEntry.objects.values_list("object_repr", "change_message")) == [
        ("default", "Paused from the admin."), ("default", "Resumed from the admin."),
        ("idle", "Paused from the admin."),
    ]  # "other" was not paused, so resuming it changed nothing


def test_queue_settings_are_edited_and_queues_added_but_not_renamed_or_deleted(admin_client, jobs):
    queue = Queue.objects.get(name="default")
    assert jobqueue.queue_settings("default").max_length is None
    change = reverse("admin:leases_tasks_queue_change", args=[queue.pk])
    form = {"name": "renamed", "paused": "on", "max_length": "10", "when_full": Queue.BUFFER,
            "full_timeout": "5"}
    assert admin_client.post(change, form).status_code == 302
    queue.refresh_from_db()
    assert (queue.name, queue.paused, queue.max_length, queue.when_full, queue.full_timeout) == (
        "default", True, 10, Queue.BUFFER, 5.0
    )
    assert jobqueue.queue_settings("default").max_length == 10

    add = reverse("admin:leases_tasks_queue_add")
    bad = admin_client.post(add, {**form, "name": "a,b"})
    assert bad.status_code == 200 and "without commas" in bad.content.decode()
    assert admin_client.post(add, {**form, "name": "", "paused": ""}).status_code == 200
    assert admin_client.post(add, {**form, "name": "mail", "paused": ""}).status_code == 302
    assert Queue.objects.filter(name="mail", paused=False, max_length=10).exists()

    assert admin_client.post(reverse("admin:leases_tasks_queue_delete", args=[queue.pk])).status_code == 403
    actions = dict(admin_client.get(QUEUES).context["action_form"].fields["action"].choices)
    assert set(actions) - {""} == {"pause_selected", "resume_selected"}


# -- workers ----------------------------------------------------------------------------


def test_worker_list_shows_liveness_heartbeat_and_running_jobs(admin_client, jobs):
    worker("w-alive", 25)
    worker("w-lapsed", -5, beat_ago=40)
    worker("w-stopped", -60, holder="", beat_ago=90)
    rows = table(admin_client.get(WORKERS), "name")
    assert {name: r["state"] for name, r in rows.items()} == {
        "w-alive": "alive", "w-lapsed": "lapsed", "w-stopped": "stopped"
    }
    assert rows["w-alive"]["heartbeat"] in ("5s ago", "6s ago") and rows["w-stopped"]["heartbeat"] == "1m ago"
    running = rows["w-alive"]["running"]
    assert running == f"sleepy #{jobs['running'].pk}, echo #{jobs['other_running'].pk}"
    assert rows["w-lapsed"]["running"] == f"sleepy #{jobs['orphan'].pk}"
    assert rows["w-stopped"]["running"] == "-"
    assert rows["w-alive"]["queues"] == "default,other" and rows["w-alive"]["concurrency"] == "4"

    detail = admin_client.get(change_url(Worker.objects.get(name="w-alive")))
    assert detail.status_code == 200 and not detail.context["adminform"].form.fields
    assert f"sleepy #{jobs['running'].pk}" in detail.content.decode()
    assert admin_client.get(reverse("admin:leases_tasks_worker_add")).status_code == 403


def test_worker_list_queries_do_not_grow_with_workers(admin_client):
    def page(expected: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            rows = table(admin_client.get(WORKERS), "name")
        assert len(rows) == expected and all(r["running"].startswith("noop #") for r in rows.values())
        return len(queries)

    def workers(first: int, last: int) -> None:
        for n in range(first, last):
            worker(f"w{n}", 30)
            make("noop", Job.RUNNING, attempt=1, worker=f"w{n}")

    workers(0, 2)
    few = page(2)
    workers(2, 12)
    assert page(12) == few
