"""Job payloads and results, their errors, durable steps' results and events' data, and
schedules' payloads and runs' errors: masked for viewers, and so neither searched nor
filtered by them (a right and a wrong guess get the same answer); those who may change
jobs or schedules search and filter as before."""
from __future__ import annotations

import pytest
from django.urls import reverse

import tests.jobs  # noqa: F401 - registers "noop"
from leases.clock import db_now
from leases.tasks import push, schedule
from leases.tasks.models import Job, JobError, JobEvent, JobStep, ScheduleRun
from tests.helpers import listed, staff

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

JOBS = reverse("admin:leases_tasks_job_changelist")
SCHEDULES = reverse("admin:leases_tasks_schedule_changelist")


@pytest.fixture
def secrets() -> Job:
    """A job whose payload, result, error, step and event each hold a credential, beside
    one that holds none."""
    push("noop", {"url": "https://example.com", "n": 1})
    job = push("noop", {"api_key": "PAYKEY-0", "url": "https://example.com"})
    now = db_now()
    Job.objects.filter(pk=job.pk).update(result={"token": "RESTOK-1"})
    JobError.objects.create(job_id=job.pk, attempt=1, exception="RuntimeError", message="refused: token ERRTOK-2",
                            traceback="", worker="w", at=now)
    JobStep.objects.create(job_id=job.pk, seq=1, name="sign_in", result={"session": "STEPSES-3"}, at=now)
    JobEvent.objects.create(job_id=job.pk, name="approved", data={"password": "EVPW-4"}, sent_at=now)
    return job


GUESSES = [
    ({"kind": "all", "q": "payload.api_key:PAYKEY-0"}, {"kind": "all", "q": "payload.api_key:WRONG-0"}),
    ({"kind": "all", "q": "payload.api_key=PAYKEY-0"}, {"kind": "all", "q": "payload.api_key=PAYKEY-1"}),
    ({"kind": "all", "q": "noop payload.api_key:PAY"}, {"kind": "all", "q": "noop payload.api_key:XAY"}),
    ({"payload__icontains": "PAYKEY-0"}, {"payload__icontains": "WRONG-0"}),
    ({"payload__api_key__startswith": "PAYK"}, {"payload__api_key__startswith": "WRON"}),
    ({"payload__api_key": "PAYKEY-0"}, {"payload__api_key": "WRONG-0"}),
    ({"payload__has_key": "api_key"}, {"payload__has_key": "password"}),
    ({"result__icontains": "RESTOK-1"}, {"result__icontains": "WRONG-1"}),
    ({"result__token__regex": "^REST"}, {"result__token__regex": "^WRON"}),
]


@pytest.mark.parametrize("right, wrong", GUESSES)
def test_a_viewer_cannot_guess_a_jobs_payload_or_result(client, secrets, right, wrong):
    staff(client, "view_job")
    assert listed(client, JOBS, **right) == listed(client, JOBS, **wrong)
    assert listed(client, JOBS, **right) in ((200, 0), (400, None))


@pytest.mark.parametrize("right, wrong", GUESSES)
def test_who_may_change_jobs_searches_and_filters_payloads_and_results_as_before(client, secrets, right, wrong):
    staff(client, "view_job", "change_job")
    assert listed(client, JOBS, **right) == (200, 1)
    assert listed(client, JOBS, **wrong) == (200, 0)


def test_a_viewers_payload_search_says_why_it_finds_nothing(client, secrets):
    staff(client, "view_job")
    response = client.get(JOBS, {"kind": "all", "q": "payload.api_key:PAYKEY-0"})
    assert [str(m) for m in response.context["messages"]] == [
        "Search: payload fields are searched only by users who may change jobs, who see payloads as stored."]
    assert listed(client, JOBS, kind="all", q="noop") == (200, 2)  # the rest of the search works
    assert listed(client, JOBS, kind="all", q=str(secrets.pk)) == (200, 1)


@pytest.mark.parametrize("right, wrong", [
    ({"errors__message__icontains": "ERRTOK-2"}, {"errors__message__icontains": "WRONG-2"}),
    ({"errors__traceback__icontains": ""}, {"errors__traceback__icontains": "x"}),
    ({"steps__result__icontains": "STEPSES-3"}, {"steps__result__icontains": "WRONG-3"}),
    ({"steps__result__session": "STEPSES-3"}, {"steps__result__session": "WRONG-3"}),
    ({"events__data__icontains": "EVPW-4"}, {"events__data__icontains": "WRONG-4"}),
    ({"errors__job__payload__icontains": "PAYKEY-0"}, {"errors__job__payload__icontains": "WRONG-0"}),
])
def test_a_viewer_cannot_guess_a_jobs_errors_steps_or_events(client, secrets, right, wrong):
    staff(client, "view_job")
    assert listed(client, JOBS, **right) == listed(client, JOBS, **wrong) == (400, None)


# -- schedules -----------------------------------------------------------------------------


@pytest.fixture
def secret_schedule():
    schedule("plain", "noop", every=60, payload={"n": 1})
    row = schedule("sync", "noop", every=60, payload={"token": "SCHTOK-5"})
    ScheduleRun.objects.create(schedule=row, number=1, fired_at=db_now(), status="failed",
                               error="refused with api_key=SCHKEY-6")


SCHEDULE_GUESSES = [
    ({"payload__icontains": "SCHTOK-5"}, {"payload__icontains": "WRONG-5"}),
    ({"payload__token__startswith": "SCH"}, {"payload__token__startswith": "XCH"}),
]


@pytest.mark.parametrize("right, wrong", [
    *SCHEDULE_GUESSES,
    ({"runs__error__icontains": "SCHKEY-6"}, {"runs__error__icontains": "WRONG-6"}),
])
def test_a_viewer_cannot_guess_a_schedules_payload_or_its_runs_errors(client, secret_schedule, right, wrong):
    staff(client, "view_schedule")
    assert listed(client, SCHEDULES, **right) == listed(client, SCHEDULES, **wrong) == (400, None)
    assert listed(client, SCHEDULES, q="SCHTOK-5") == listed(client, SCHEDULES, q="WRONG-5") == (200, 0)


@pytest.mark.parametrize("right, wrong", SCHEDULE_GUESSES)
def test_who_may_change_schedules_filters_by_payload_as_before(client, secret_schedule, right, wrong):
    staff(client, "view_schedule", "change_schedule")
    assert listed(client, SCHEDULES, **right) == (200, 1)
    assert listed(client, SCHEDULES, **wrong) == (200, 0)
