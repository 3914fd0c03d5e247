"""What operators see and do of durable jobs in the admin and on the dashboard: a job's
"Steps and events" (its steps and the events no wait took yet, masked for those who may
only view jobs, as payloads are; none for a plain job), the "send event" action (its
form, one-line errors that write nothing, each job sent to and the send in its history),
the list's status of suspended jobs, and the suspended jobs the dashboard's panel and the
metric leases_jobs_suspended count per queue.

The rows are made by the engine, through the durable handlers of test_durable_operators."""
from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

import tests.jobs  # noqa: F401 - registers noop, a plain handler
from leases.ops.masking import MASK
from leases.tasks import push
from leases.tasks.jobs.steps import EVENT_NAME_LENGTH, send_event
from leases.tasks.models import Job, JobEvent
from leases.tasks.worker import JobWorker
from tests.helpers import table
from tests.tasks.test_durable_operators import OTHER, QUEUE, ended, suspended, work

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

JOBS = reverse("admin:leases_tasks_job_changelist")
HEADING = "Steps and events"
PANEL = "Durable jobs suspended"


def page(client, job: Job) -> str:
    response = client.get(reverse("admin:leases_tasks_job_change", args=[job.pk]))
    assert response.status_code == 200
    return response.content.decode()


def durable_part(html: str) -> str:
    """The "Steps and events" fieldset of a job's page."""
    start = html.index(f">{HEADING}</h2>")
    return html[start : html.index("</fieldset>", start)]


def staff(client, *codenames: str) -> User:
    user = User.objects.create_user("-".join(codenames), password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(content_type__app_label="leases_tasks",
                                                         codename__in=codenames))
    client.force_login(user)
    return user


def send(client, pks, **form: str):
    """The action, its form filled in and sent ("apply"), or just asked for."""
    data = {"action": "send_event_selected", "_selected_action": list(pks), **form}
    return client.post(JOBS, data, follow=True)


def messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def secret_wait() -> Job:
    """A job that stepped (a credential in the step's result) and waits, with an event of
    another name kept for it (a credential in its data)."""
    job = suspended("ops.approve", {"timeout": 600})
    send_event(job.pk, "resized", {"password": "pw-2", "size": 3})
    return job


# -- a job's page -------------------------------------------------------------------------


def test_a_durable_jobs_page_shows_what_it_waits_for_its_steps_and_kept_events(admin_client, secret_wait):
    part = durable_part(page(admin_client, secret_wait))
    assert "Waits for:" in part and "the event &#x27;approved&#x27;, or its timeout " in part
    assert "<td>1</td><td>fetch</td><td>done</td>" in part
    assert "&quot;token&quot;: &quot;tok-1&quot;" in part  # who may change jobs: as stored
    assert "<td>2</td><td>wait:approved</td><td>until " in part
    assert "<td>resized</td>" in part and "not yet: kept for a wait" in part
    assert "&quot;password&quot;: &quot;pw-2&quot;" in part and MASK not in part


def test_a_viewer_sees_step_results_and_event_data_masked(client, secret_wait):
    staff(client, "view_job")
    html = page(client, secret_wait)
    part = durable_part(html)
    assert "tok-1" not in html and "pw-2" not in html
    assert f"&quot;token&quot;: &quot;{MASK}&quot;" in part
    assert f"&quot;password&quot;: &quot;{MASK}&quot;" in part
    assert "&quot;size&quot;: 3" in part and "<td>fetch</td>" in part  # the rest stays readable


def test_who_may_change_jobs_sees_them_as_stored(client, secret_wait):
    staff(client, "view_job", "change_job")
    part = durable_part(page(client, secret_wait))
    assert "tok-1" in part and "pw-2" in part and MASK not in part


def test_a_taken_event_says_which_step_took_it_and_an_ended_job_keeps_its_steps(admin_client):
    job = ended({"page": 2})
    part = durable_part(page(admin_client, job))
    assert "Waits for:" not in part  # it ended
    assert "<td>2</td><td>wait:approved</td><td>done</td>" in part and "&quot;data&quot;: null" in part
    assert "<td>approved</td>" in part and "by step 2" in part


def test_a_long_result_is_cut_with_the_whole_of_it_folded_beneath(admin_client):
    job = suspended("ops.nap", {"sleep": 3600, "long": "y" * 300})
    part = durable_part(page(admin_client, job))
    assert "<details><summary>{&quot;long&quot;: &quot;" + "y" * 60 in part
    assert "y" * 300 in part  # folded, whole


def test_a_plain_job_has_no_steps_and_events(admin_client):
    job = push("noop", {"n": 1})
    JobWorker(queues=["default"], burst=True, poll=0.01).run()
    html = page(admin_client, Job.objects.get(pk=job.pk))
    assert Job.objects.get(pk=job.pk).status == Job.SUCCEEDED
    assert "Payload and result" in html and HEADING not in html


# -- the list -----------------------------------------------------------------------------


def test_the_list_says_which_jobs_sleep_or_wait_after_a_retry_too(admin_client):
    sleeping = suspended("ops.nap", {"sleep": 3600})
    waiting = suspended("ops.approve.b", {"fail_first": True})
    woken = suspended("ops.approve", {})
    send_event(woken.pk, "approved", 1)
    found = table(admin_client.get(JOBS), "id")
    assert [found[str(job.pk)]["status_text"] for job in (sleeping, waiting, woken)] == [
        "sleeping", "waiting for 'approved'", "ready"]
    assert found[str(waiting.pk)]["attempts"] == "1/3"


# -- the send-event action ------------------------------------------------------------------


def test_the_action_asks_for_the_events_name_and_data(admin_client):
    jobs = [suspended("ops.approve", {"n": n}) for n in range(2)]
    response = send(admin_client, [job.pk for job in jobs])
    assert response.status_code == 200
    assert [t.name for t in response.templates][0] == "admin/leases_tasks/job/send_event.html"
    html = response.content.decode()
    assert "<h1>Send an event</h1>" in html and f"<li>#{jobs[0].pk} ops.approve</li>" in html
    assert html.count('name="_selected_action"') == 2 and 'name="apply"' in html
    assert not JobEvent.objects.exists()


@pytest.mark.parametrize("form, field, error", [
    ({"name": "", "data": "1"}, "name", "This field is required."),
    ({"name": "   ", "data": "1"}, "name", "This field is required."),
    ({"name": "approved", "data": "{bad"}, "data", "data is not valid JSON: Expecting property name"),
    ({"name": "approved", "data": "[" * 100_000}, "data", "data is nested too deeply"),
    ({"name": "approved", "data": "NaN"}, "data", "the event&#x27;s data must be JSON-serialisable"),
    ({"name": "x" * (EVENT_NAME_LENGTH + 1), "data": ""}, "name", f"at most {EVENT_NAME_LENGTH} characters"),
    ({"name": "tab\tin", "data": ""}, "name", "must not contain control or invisible characters"),
])
def test_a_bad_name_or_data_is_a_one_line_form_error_and_sends_nothing(admin_client, form, field, error):
    job = suspended("ops.approve", {})
    response = send(admin_client, [job.pk], apply="Send", **form)
    assert response.status_code == 200 and "<h1>Send an event</h1>" in response.content.decode()
    errors = response.context["form"].errors
    assert list(errors) == [field] and len(errors[field]) == 1 and "\n" not in errors[field][0]
    assert error in response.content.decode()
    assert not JobEvent.objects.exists() and not LogEntry.objects.exists()
    assert Job.objects.get(pk=job.pk).run_at == job.run_at  # not woken


def test_the_action_sends_to_each_selected_job_that_has_not_ended_and_logs_it(admin_client):
    waiting = suspended("ops.approve", {"timeout": 600})
    sleeping = suspended("ops.nap", {"sleep": 3600})
    done = ended()
    response = send(admin_client, [waiting.pk, sleeping.pk, done.pk], apply="Send", name="approved",
                    data='{"by": "ana"}')
    assert messages(response) == [
        "Sent the event 'approved' to 2 of 3 selected job(s). Not sent: job #"
        f"{done.pk} has ended (succeeded): the event 'approved' was not sent"
    ]
    sent = JobEvent.objects.filter(sent_at__gt=Job.objects.get(pk=done.pk).finished_at).order_by("job_id")
    assert [(e.job_id, e.name, e.data) for e in sent] == [(waiting.pk, "approved", {"by": "ana"}),
                                                          (sleeping.pk, "approved", {"by": "ana"})]
    logged = LogEntry.objects.order_by("object_id")
    assert [(int(e.object_id), e.change_message) for e in logged] == [
        (waiting.pk, "Sent the event 'approved' from the admin."),
        (sleeping.pk, "Sent the event 'approved' from the admin."),
    ]
    work()  # the waiting job was woken and takes it; the sleeping one keeps it for a wait
    assert Job.objects.get(pk=waiting.pk).result == {"approved": {"by": "ana"}}
    assert Job.objects.get(pk=sleeping.pk).status == Job.READY


def test_viewers_are_not_offered_the_action(client):
    job = suspended("ops.approve", {})
    staff(client, "view_job")
    assert "send_event_selected" not in client.get(JOBS).content.decode()
    response = send(client, [job.pk], apply="Send", name="approved", data="")
    assert not JobEvent.objects.exists() and response.status_code == 200


# -- cancel (test_queue_admin covers plain jobs) ---------------------------------------------


def test_cancel_ends_suspended_jobs_and_asks_a_running_one_to_stop_again_without_error(admin_client):
    """A sleeping or waiting job is waiting: cancelled at once. A running one already asked
    to stop is asked again (the first time it was asked stays), not "ended already"."""
    sleeping = suspended("ops.nap", {"sleep": 3600})
    waiting = suspended("ops.approve", {"timeout": 600})
    again = suspended("ops.approve", {})
    send_event(again.pk, "approved", 1)
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (running,) = worker.claim(1)
    try:
        assert running.id == again.pk
        cancel = {"action": "cancel_selected", "_selected_action": [running.id]}
        assert messages(admin_client.post(JOBS, cancel, follow=True)) == [
            "Cancelled 1 of 1 selected job. 1 running: asked to stop at their worker's next heartbeat."]
        asked = Job.objects.get(pk=running.id).cancel_requested_at
        assert "Cancel requested at:" in durable_part(page(admin_client, Job.objects.get(pk=running.id)))
        done = ended()
        cancel["_selected_action"] = [sleeping.pk, waiting.pk, running.id, done.pk]
        assert messages(admin_client.post(JOBS, cancel, follow=True)) == [
            "Cancelled 3 of 4 selected jobs. 1 running: asked to stop at their worker's next heartbeat."
            " 1 ended already."]
        statuses = dict(Job.objects.values_list("pk", "status"))
        assert [statuses[pk] for pk in (sleeping.pk, waiting.pk, running.id, done.pk)] == [
            Job.CANCELLED, Job.CANCELLED, Job.RUNNING, Job.SUCCEEDED]
        assert Job.objects.get(pk=running.id).cancel_requested_at == asked
        assert table(admin_client.get(JOBS), "id")[str(sleeping.pk)]["status_text"] == "cancelled"
    finally:
        worker.hand_back()


# -- the dashboard and the metrics ------------------------------------------------------------


def panel(client) -> str:
    response = client.get(reverse("leases:dashboard"))
    assert response.status_code == 200
    (found,) = [p for p in response.context["panels"] if p.heading == PANEL]
    return str(found.chart)


def suspended_metric(client) -> dict[tuple[str, str], float]:
    response = client.get(reverse("leases:metrics"))
    assert response.status_code == 200
    return {(s.labels["queue"], s.labels["kind"]): s.value
            for family in text_string_to_metric_families(response.content.decode())
            if family.name == "leases_jobs_suspended" for s in family.samples}


def test_the_panel_and_the_metric_count_sleeping_and_waiting_jobs_per_queue(admin_client):
    for _ in range(2):
        suspended("ops.nap", {"sleep": 3600})
    suspended("ops.approve", {"timeout": 600})
    suspended("ops.approve.b", {"fail_first": True})
    woken = suspended("ops.approve.b", {})
    send_event(woken.pk, "approved", None)  # due now: it waits for a worker, not for an event
    push("ops.nap", {"sleep": 60}, delay=600)  # not run yet
    chart = panel(admin_client)
    assert f"{QUEUE}" in chart and "2 sleeping · 1 waiting for an event" in chart
    assert f"{OTHER}" in chart and "0 sleeping · 1 waiting for an event" in chart
    assert suspended_metric(admin_client) == {
        (QUEUE, "sleeping"): 2.0, (QUEUE, "event"): 1.0, (OTHER, "sleeping"): 0.0, (OTHER, "event"): 1.0,
    }


def test_with_none_suspended_the_panel_says_so_and_the_metric_is_empty(admin_client):
    push("ops.nap", {"sleep": 60}, delay=600)
    ended()
    assert "No durable job sleeps or waits for an event." in panel(admin_client)
    assert suspended_metric(admin_client) == {}
