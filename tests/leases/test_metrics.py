"""The Prometheus endpoint: values read from the tables by the database clock, its access
rules (the bearer token reads everything, staff the families of the models they may view),
internal jobs left out of the outcomes, both spellings of its URL, its answer without
prometheus_client, and a query count that does not grow with rows."""
from __future__ import annotations

import sys
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

import leases.metrics
import leases.ops.metrics
from leases.clock import db_now
from leases.locks import acquire_lock
from leases.pipelines import machine
from leases.pipelines.models import Run
from leases.pool import Pool
from leases.tasks.dispatcher import Dispatcher
from leases.tasks.models import Job, Queue

pytestmark = pytest.mark.django_db(transaction=True)

URL = reverse("leases:metrics")
TOKEN = "s3cret-token"
#: The families each view permission shows.
FAMILIES = {
    "leases.view_resource": {"leases_resources", "leases_lease_acquisitions", "leases_locks_held",
                             "leases_resource_bans"},
    "leases_tasks.view_job": {
        "leases_jobs", "leases_queue_oldest_due_age_seconds", "leases_queue_paused", "leases_job_outcomes",
        "leases_job_duration_mean_seconds", "leases_job_duration_max_seconds", "leases_jobs_waiting_for_resource",
        "leases_jobs_suspended",
    },
    "leases_tasks.view_taskpool": {"leases_dispatcher_tasks", "leases_dispatcher_workers"},
    "leases_pipelines.view_run": {"leases_pipeline_runs"},
}


def job(name: str, status: int, queue: str = "default", ran: float | None = None, ended_ago: float = 60,
        run_in: float = -30) -> Job:
    """A job row as the engine leaves it: `ran` seconds of run time ending `ended_ago`
    seconds ago (by the database clock) for a finished one."""
    now = db_now()
    finished = now - timedelta(seconds=ended_ago) if status in Job.FINISHED else None
    started = None
    if status == Job.RUNNING:
        started = now - timedelta(seconds=5)
    elif ran is not None:
        started = finished - timedelta(seconds=ran)
    return Job.objects.create(
        queue=queue, name=name, key=f"{name}-{Job.objects.count()}", status=status,
        run_at=now + timedelta(seconds=run_in), enqueued_at=now - timedelta(minutes=10),
        started_at=started, finished_at=finished,
    )


def run(pipeline: str, status: str, ended_ago: float | None = None) -> Run:
    now = db_now()
    return Run.objects.create(
        pipeline=pipeline, status=status, definition={}, queued_at=now - timedelta(hours=3),
        finished_at=None if ended_ago is None else now - timedelta(seconds=ended_ago),
    )


@pytest.fixture
def scene() -> None:
    """Two pools, two locks, jobs of every status in two queues, a dispatcher, runs."""
    proxies = Pool("proxies")
    for name in ("p1", "p2", "p3", "p4", "p5"):
        proxies.add(name)
    Pool("accounts").add("a1", slots=2)
    held = [proxies.acquire(ttl=600, holder=f"crawler-{n}") for n in range(3)]
    held[2].release(cooldown=600)  # cooling: rests without a holder
    free = proxies.resources().filter(holder="", busy_before__lte=db_now()).values_list("name", flat=True)
    proxies.quarantine(min(free), 86400, "banned")
    acquire_lock("nightly", ttl=600)
    acquire_lock("short", ttl=600).release()

    Queue.objects.create(name="default")
    Queue.objects.create(name="idle", paused=True)
    job("echo", Job.READY, run_in=-30)
    job("echo", Job.READY, run_in=-10)
    job("echo", Job.READY, run_in=60)  # not due yet
    job("echo", Job.BLOCKED)
    job("sleepy", Job.RUNNING)
    for seconds in (1, 2, 3):
        job("echo", Job.SUCCEEDED, ran=seconds)
    job("boom", Job.FAILED, ran=5)
    job("boom", Job.DEAD, ran=10)
    job("echo", Job.CANCELLED)  # cancelled while waiting: never ran
    job("echo", Job.SUCCEEDED, ran=100, ended_ago=7200)  # before the window
    job("send", Job.RUNNING, queue="mail")
    job("send", Job.SUCCEEDED, queue="mail", ran=0.5)

    crawl = Dispatcher("crawl")
    crawl.recreate_task_pool({f"https://example.com/{n}": float(n) for n in range(10)})
    crawl.assign_tasks(3, "worker-1")

    run("nightly", Run.RUNNING)
    run("nightly", Run.PAUSED)
    run("nightly", Run.SUCCEEDED, ended_ago=600)
    run("nightly", Run.SUCCEEDED, ended_ago=900)
    run("nightly", Run.FAILED, ended_ago=7200)  # before the window


def scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the endpoint's answer, as Prometheus parses it."""
    response = client.get(URL, **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def value(found: dict, metric: str, /, **labels: str) -> float:
    return found[metric, tuple(sorted(labels.items()))]


def families(client, url: str = URL, **headers) -> dict[str, str]:
    """{family name: its help} of the endpoint's answer."""
    response = client.get(url, **headers)
    assert response.status_code == 200, response.content
    return {family.name: family.documentation for family in text_string_to_metric_families(response.content.decode())}


def staff(name: str, *permissions: str) -> User:
    user = User.objects.create_user(name, password="pw", is_staff=True)
    for permission in permissions:
        app_label, codename = permission.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    return user


def test_metrics_report_pools_locks_jobs_dispatchers_and_runs(admin_client, scene):
    found = scrape(admin_client)

    states = {state: value(found, "leases_resources", pool="proxies", state=state)
              for state in ("free", "held", "cooling", "quarantined")}
    assert states == {"free": 1, "held": 2, "cooling": 1, "quarantined": 1}
    assert value(found, "leases_resources", pool="accounts", state="free") == 2
    # three acquisitions and a quarantine bumped the tokens; nothing was ever leased in accounts
    assert value(found, "leases_lease_acquisitions_total", pool="proxies") == 4
    assert value(found, "leases_lease_acquisitions_total", pool="accounts") == 0
    assert value(found, "leases_locks_held") == 1  # nightly; short and the rebuild lock were released

    jobs = {status: value(found, "leases_jobs", queue="default", status=status)
            for status in ("ready", "blocked", "running", "succeeded", "failed", "dead", "cancelled")}
    assert jobs == {"ready": 3, "blocked": 1, "running": 1, "succeeded": 3, "failed": 1, "dead": 1,
                    "cancelled": 1}
    assert value(found, "leases_jobs", queue="mail", status="running") == 1
    assert value(found, "leases_jobs", queue="idle", status="ready") == 0  # known queues report zeros
    assert 29 <= value(found, "leases_queue_oldest_due_age_seconds", queue="default") < 40
    assert value(found, "leases_queue_oldest_due_age_seconds", queue="mail") == 0
    assert value(found, "leases_queue_paused", queue="idle") == 1
    assert value(found, "leases_queue_paused", queue="default") == 0

    assert value(found, "leases_job_outcomes", queue="default", name="echo", status="succeeded") == 3
    assert value(found, "leases_job_outcomes", queue="default", name="echo", status="cancelled") == 1
    assert value(found, "leases_job_outcomes", queue="default", name="boom", status="dead") == 1
    # the mean is over the jobs that ran: the cancelled one never started
    assert value(found, "leases_job_duration_mean_seconds", queue="default", name="echo") == pytest.approx(2)
    assert value(found, "leases_job_duration_max_seconds", queue="default", name="echo") == pytest.approx(3)
    assert value(found, "leases_job_duration_mean_seconds", queue="default", name="boom") == 7.5
    assert value(found, "leases_job_duration_max_seconds", queue="mail", name="send") == pytest.approx(0.5)
    assert ("leases_job_duration_mean_seconds", (("name", "sleepy"), ("queue", "default"))) not in found

    assert value(found, "leases_dispatcher_tasks", dispatcher="crawl", state="pool") == 7
    assert value(found, "leases_dispatcher_tasks", dispatcher="crawl", state="bucket") == 3
    assert value(found, "leases_dispatcher_workers", dispatcher="crawl") == 1

    runs = {key[1]: v for key, v in found.items() if key[0] == "leases_pipeline_runs"}
    assert runs == {
        (("pipeline", "nightly"), ("status", "running")): 1,
        (("pipeline", "nightly"), ("status", "paused")): 1,
        (("pipeline", "nightly"), ("status", "succeeded")): 2,
    }


def test_metrics_judge_time_by_the_database_clock(admin_client, scene, monkeypatch):
    real, reads = leases.ops.metrics.db_now, []
    monkeypatch.setattr(
        leases.ops.metrics, "db_now", lambda using=None: reads.append(1) or real(using) + timedelta(hours=2)
    )
    found = scrape(admin_client)
    assert len(reads) == 1
    assert value(found, "leases_jobs", queue="default", status="succeeded") == 0  # all over an hour ago now
    assert value(found, "leases_resources", pool="proxies", state="held") == 0  # their ttl ran out
    assert value(found, "leases_resources", pool="proxies", state="free") == 4
    assert value(found, "leases_resources", pool="proxies", state="quarantined") == 1  # for a day
    assert value(found, "leases_queue_oldest_due_age_seconds", queue="default") > 7200


def test_metrics_take_staff_or_the_bearer_token(client, settings, scene):
    assert client.get(URL).status_code == 403
    client.force_login(User.objects.create_user("user", password="pw"))
    assert client.get(URL).status_code == 403
    client.logout()
    assert client.get(URL, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 403  # no token configured
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer ").status_code == 403

    settings.LEASES_METRICS_TOKEN = TOKEN
    assert scrape(client, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert scrape(client, HTTP_AUTHORIZATION=f"bearer {TOKEN}")
    for wrong in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer ", f"Bearer {TOKEN[:-1]}"):
        assert client.get(URL, HTTP_AUTHORIZATION=wrong).status_code == 403, wrong

    client.force_login(staff("staff"))
    assert client.get(URL).status_code == 403  # staff who may view none of the models read
    client.force_login(staff("viewer", "leases.view_resource"))
    assert scrape(client)
    assert client.post(URL).status_code == 405


def test_staff_read_the_families_of_the_models_they_may_view(client, settings, scene):
    for n, permission in enumerate(FAMILIES):
        client.force_login(staff(f"staff{n}", permission))
        assert set(families(client)) == FAMILIES[permission], permission
    client.force_login(staff("two", "leases.view_resource", "leases_pipelines.view_run"))
    found = scrape(client)
    assert {name for name, _ in found} == {
        "leases_resources", "leases_lease_acquisitions_total", "leases_locks_held", "leases_pipeline_runs"
    }
    assert 'pool="proxies"' in client.get(URL).content.decode()
    assert "queue=" not in client.get(URL).content.decode()  # no queue's name leaks

    client.logout()
    settings.LEASES_METRICS_TOKEN = TOKEN
    assert set(families(client, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")) == set().union(*FAMILIES.values())


def test_the_endpoint_answers_with_and_without_a_trailing_slash(client, settings, scene):
    settings.LEASES_METRICS_TOKEN = TOKEN
    bearer = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    assert families(client, "/leases/metrics", **bearer) == families(client, "/leases/metrics/", **bearer)
    assert client.get("/leases/metrics/").status_code == 403


def test_internal_jobs_are_left_out_of_the_outcomes(admin_client):
    """A pipeline's advance events are the engine's bookkeeping, not the operators' work."""
    for _ in range(2):
        job("echo", Job.SUCCEEDED, queue="q", ran=1)
    for _ in range(5):
        job(machine.EVENT, Job.SUCCEEDED, queue="q", ran=1)
    job(machine.EVENT, Job.DEAD, queue="q", ran=1)
    found = scrape(admin_client)
    assert value(found, "leases_jobs", queue="q", status="succeeded") == 2
    assert value(found, "leases_jobs", queue="q", status="dead") == 0
    assert value(found, "leases_job_outcomes", queue="q", name="echo", status="succeeded") == 2
    assert not [key for key in found if ("name", machine.EVENT) in key[1]]
    helps = families(admin_client)
    assert "left out" in helps["leases_jobs"] and "left out" in helps["leases_job_outcomes"]


def test_without_prometheus_client_the_endpoint_says_what_to_install(admin_client, client, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` fails
    response = admin_client.get(URL)
    assert response.status_code == 501
    assert response.content.decode().strip().endswith("pip install django-leases[metrics]")
    assert len(response.content.decode().splitlines()) == 1
    assert client.get(URL).status_code == 403  # strangers learn nothing more


def test_registering_the_collector_elsewhere_reads_nothing(scene):
    from prometheus_client import CollectorRegistry

    with CaptureQueriesContext(connection) as queries:
        CollectorRegistry(auto_describe=True).register(leases.metrics.LeasesCollector())
    assert len(queries) == 0


def test_metrics_queries_do_not_grow_with_rows(client, settings, scene):
    settings.LEASES_METRICS_TOKEN = TOKEN

    def cost() -> int:
        with CaptureQueriesContext(connection) as queries:
            scrape(client, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        return len(queries)

    few = cost()
    for n in range(4):
        Queue.objects.create(name=f"q{n}")
        for status in (Job.READY, Job.RUNNING, Job.BLOCKED):
            job(f"task{n}", status, queue=f"q{n}")
        for status in (Job.SUCCEEDED, Job.FAILED, Job.DEAD):
            job(f"task{n}", status, queue=f"q{n}", ran=n + 1)
        Pool(f"pool{n}").add("r", slots=3)
        Dispatcher(f"dispatcher{n}").recreate_task_pool({f"t{i}": float(i) for i in range(20)})
        run(f"pipeline{n}", Run.RUNNING)
        run(f"pipeline{n}", Run.SUCCEEDED, ended_ago=60)
    found = scrape(client, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert value(found, "leases_dispatcher_tasks", dispatcher="dispatcher3", state="pool") == 20
    assert cost() == few
    # the readings: resources, locks, bans, jobs waiting, queues, jobs finished, dispatchers, live and
    # ended runs, durable jobs suspended (and, unseen here, through leases.db, the jobs waiting for a
    # resource per pool)
    assert few == 10
