"""What operators see of jobs that hold resources: the pairing of a running job and its
resource in the admin and the commands, a pool's waiting jobs and why, per-target bans
with the action that lifts them, and the metrics."""
from __future__ import annotations

import io

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.urls import reverse

import tests.tasks.test_leased_jobs  # noqa: F401 - registers lease.fetch (pool "proxies", target: the site)
from leases import Pool, targets
from leases.models import Resource, Verdict
from leases.tasks import push
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def out(*args: str) -> str:
    buffer = io.StringIO()
    call_command(*args, stdout=buffer)
    return buffer.getvalue()


@pytest.fixture
def running():
    """A job of pool "proxies" running on resource p1, another waiting: the pool's only."""
    Pool("proxies").add("p1")
    first = push("lease.fetch", {"n": 1, "site": "a.example"})
    second = push("lease.fetch", {"n": 2, "site": "a.example"})
    worker = JobWorker(queues=["crawl"], ttl=30)
    worker.register()
    (job,) = worker.claim(2)
    yield {"job": job, "first": first, "second": second, "worker": worker}
    worker.hand_back()


def test_commands_show_the_pairing_and_a_pools_waiting_jobs(running):
    job, resource = running["job"], Resource.objects.get(pool="proxies", name="p1")
    listed = out("jobs", "list", "--queue", "crawl")
    assert "HOLDS" in listed and f"proxies/p1 token {resource.token}" in listed
    shown = out("jobs", "show", str(job.id))
    assert "target" in shown and "a.example" in shown and f"proxies/p1 token {resource.token}" in shown
    assert f"job #{job.id} (" in out("lease", "list", "proxies")
    stats = out("jobs", "stats").splitlines()
    at = stats.index("due jobs that need a resource:")
    assert stats[at + 1].split() == ["POOL", "TARGET", "DUE", "USABLE", "NOT", "USABLE", "NEXT", "USABLE"]
    assert stats[at + 2].split() == ["proxies", "a.example", "1", "0/1", "1", "held", "when", "a", "holder", "lets",
                                     "go"]


def test_the_admin_shows_the_pairing_and_lifts_per_target_bans(admin_client, running):
    job, resource = running["job"], Resource.objects.get(pool="proxies", name="p1")
    page = admin_client.get(reverse("admin:leases_tasks_job_change", args=[job.id])).content.decode()
    assert "proxies/p1" in page and f"token {resource.token}" in page and "a.example" in page
    waiting = admin_client.get(reverse("admin:leases_tasks_job_change", args=[running["second"].pk])).content
    assert (b"nothing yet: it is claimed only together with a free resource of its pool (0 of 1 resources usable"
            b" for a.example: 1 held; the next when a holder lets go)") in waiting
    targets.ban("proxies", "p1", "b.example", 600, reason="403 at b")
    page = admin_client.get(reverse("admin:leases_resource_change", args=[resource.pk])).content.decode()
    assert f"job #{job.id}</a>" in page and "b.example: banned until" in page and "403 at b" in page
    done = admin_client.post(reverse("admin:leases_resource_changelist"),
                             {"action": "lift_selected", "_selected_action": [resource.pk]}, follow=True)
    assert done.status_code == 200
    assert not targets.unusable_now("proxies", "b.example", ["p1"])
    assert LogEntry.objects.filter(object_id=str(resource.pk), change_message__contains="Lifted").exists()
    lifted = Verdict.objects.get(kind="lift")  # the verdicts' log names the admin user too
    assert (lifted.name, lifted.target, lifted.holder) == ("p1", "b.example", "admin: admin")


def test_the_dashboard_and_metrics_count_jobs_waiting_for_a_pool_and_bans(admin_client, running):
    targets.ban("proxies", "p1", "b.example", 600)
    dashboard = admin_client.get(reverse("leases:dashboard")).content.decode()
    assert "Jobs waiting for a resource" in dashboard and "proxies" in dashboard
    metrics = admin_client.get(reverse("leases:metrics")).content.decode()
    assert 'leases_jobs_waiting_for_resource{pool="proxies"} 1.0' in metrics
    assert 'leases_resource_bans{pool="proxies",target="b.example"} 1.0' in metrics
