"""What view-only staff see of secrets: a schedule's payload and its runs' errors, and the
positional arguments of a Django task's job, masked; operators see them as stored."""
from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

import tests.jobs  # noqa: F401 - registers "noop"
from leases.clock import db_now
from leases.ops.masking import MASK
from leases.tasks import schedule
from leases.tasks.models import Job, ScheduleRun

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

VIEW_SCHEDULES = ["view_schedule", "view_schedulerun"]
VIEW_JOBS = ["view_job", "view_joberror"]


@task()
def sign_in(user: str, password: str, *tokens: str, region: str = "eu") -> None:
    """Enqueued by the tests below, never run."""


def page_of(client, permissions: list[str], url: str) -> str:
    user = User.objects.create_user("-".join(permissions), password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=permissions))
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 200
    return response.content.decode()


@pytest.fixture
def secret_schedule() -> str:
    """A schedule whose payload and whose run's error each hold credentials; its page."""
    row = schedule("sync", "noop", every=60, payload={"token": "tok-1", "proxy": "http://u:pw-2@proxy:3128",
                                                      "headers": [["Authorization", "Bearer tok-3"]]})
    ScheduleRun.objects.create(schedule=row, number=1, fired_at=db_now(), status="failed",
                               error="RuntimeError: refused https://api/?api_key=key-4 with token tok-5")
    return reverse("admin:leases_tasks_schedule_change", args=[row.pk])


def test_viewers_see_a_schedules_payload_and_run_errors_masked(client, secret_schedule):
    page = page_of(client, VIEW_SCHEDULES, secret_schedule)
    for secret in ("tok-1", "pw-2", "tok-3", "key-4", "tok-5"):
        assert secret not in page
    assert f"&quot;token&quot;: &quot;{MASK}&quot;" in page and f"http://u:{MASK}@proxy:3128" in page
    assert f"api_key={MASK} with token {MASK}" in page
    assert "sync" in page and "RuntimeError: refused" in page  # the rest as it is


def test_who_may_change_a_schedule_edits_its_payload_as_stored(client, secret_schedule):
    page = page_of(client, [*VIEW_SCHEDULES, "change_schedule"], secret_schedule)
    for secret in ("tok-1", "pw-2", "tok-3", "key-4", "tok-5"):
        assert secret in page
    assert 'name="payload"' in page and MASK not in page


def test_a_schedule_is_added_with_a_payload_by_who_may_add_but_not_change(client):
    page = page_of(client, ["add_schedule", "view_schedule"], reverse("admin:leases_tasks_schedule_add"))
    assert 'name="payload"' in page


def test_viewers_see_a_tasks_positional_credentials_masked(client):
    result = sign_in.enqueue("bob", "hunter2", "tok-a", "tok-b", region="us")
    url = reverse("admin:leases_tasks_job_change", args=[result.id])
    page = page_of(client, VIEW_JOBS, url)
    assert "hunter2" not in page and "tok-a" not in page and "tok-b" not in page
    assert "&quot;bob&quot;" in page and "&quot;us&quot;" in page and page.count(MASK) == 3


def test_a_tasks_arguments_are_all_masked_when_its_module_cannot_be_read(client):
    job = Job.objects.create(queue="default", name="gone.module.task", backend="default", key="task:gone",
                             payload={"args": ["bob", "hunter2"], "kwargs": {}}, run_at=db_now(),
                             enqueued_at=db_now())
    page = page_of(client, VIEW_JOBS, reverse("admin:leases_tasks_job_change", args=[job.pk]))
    assert "hunter2" not in page and "&quot;bob&quot;" not in page and page.count(MASK) == 2


def test_operators_see_a_tasks_arguments_as_stored(client):
    result = sign_in.enqueue("bob", "hunter2")
    page = page_of(client, [*VIEW_JOBS, "change_job"], reverse("admin:leases_tasks_job_change", args=[result.id]))
    assert "hunter2" in page and MASK not in page
