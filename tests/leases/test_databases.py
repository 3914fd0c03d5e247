"""Pools, locks, dispatchers and queues spread over two databases by LEASES_ROUTES: each
statement goes to its name's database and no other; bad routes are refused at start."""
from __future__ import annotations

import json
import subprocess
from contextlib import contextmanager

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.db import connections

import leases.db
import tests.jobs  # noqa: F401 - registers the handlers
from leases import Pool, break_lock, conf, lock, routing
from leases.locks import acquire_lock
from leases.models import Lock, Resource
from leases.tasks import Dispatcher, push, push_many
from leases.tasks.models import Job, PoolTask, Queue, TaskPool
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True, databases=["default", "second"]),
              pytest.mark.usefixtures("fresh_queue_settings")]

ROUTES = {
    "pools": {"eu-*": "second"},
    "locks": {"eu:*": "second"},
    "dispatchers": {"eu-crawl": "second"},
    "queues": {"other": "second"},  # tests.jobs's echo handler runs on "other"
}


@pytest.fixture
def routed(settings):
    settings.LEASES_ROUTES = ROUTES


@contextmanager
def statements():
    """Every statement sent, by alias: the engine's own cursor and the ORM's."""
    sent: dict[str, list[str]] = {"default": [], "second": []}
    real = leases.db.Cursor.execute

    def engine(cursor, sql, params=()):
        sent[cursor.db.alias].append(sql)
        return real(cursor, sql, params)

    def orm(alias):
        def wrapper(execute, sql, params, many, context):
            sent[alias].append(sql)
            return execute(sql, params, many, context)
        return wrapper

    leases.db.Cursor.execute = engine
    try:
        with connections["default"].execute_wrapper(orm("default")), \
                connections["second"].execute_wrapper(orm("second")):
            yield sent
    finally:
        leases.db.Cursor.execute = real


# -- routes ------------------------------------------------------------------------------


@pytest.mark.parametrize("routes, message", [
    ({"pool": {"x": "second"}}, "unknown kind 'pool'"),
    ({"pools": {"x*": "elsewhere"}}, "names 'elsewhere', which is not in DATABASES"),
    ({"pools": {"a*b": "second"}}, "must be a name, or a prefix and one trailing *"),
    ({"pools": {"*": "second"}}, "must be a name, or a prefix and one trailing *"),
    ({"queues": {"crawl*": "second", "crawl-eu*": "default"}},
     "'crawl*' and 'crawl-eu*' both match 'crawl-eu' but name different databases ('second', 'default')"),
    ({"queues": {"crawl*": "second", "crawl.fetch": "default"}}, "both match 'crawl.fetch'"),
    ({"locks": ["x"]}, "must map name patterns to database aliases"),
    (["x"], "LEASES_ROUTES must be a dict"),
])
def test_bad_routes_are_a_system_check_error_and_refused_at_use(settings, routes, message):
    settings.LEASES_ROUTES = routes
    errors = [e for e in run_checks() if e.id == "leases.E006"]
    assert len(errors) == 1 and message in errors[0].msg
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        Pool("x")
    assert not Resource.objects.using("second").exists()


def test_overlapping_patterns_to_one_database_are_fine(settings):
    settings.LEASES_ROUTES = {"queues": {"crawl*": "second", "crawl-eu*": "second", "crawl": "second"}}
    assert conf.route_problems(settings.LEASES_ROUTES) == []
    assert routing.route("queues", "crawl-eu-1") == "second" and routing.route("queues", "mail") == "default"


def test_names_go_where_the_routes_say_and_using_wins(routed):
    assert routing.route("pools", "eu-proxies") == "second"
    assert routing.route("pools", "eu") == "default"  # the prefix is "eu-"
    assert routing.route("pools", "eu-proxies", using="default") == "default"
    assert routing.aliases() == ["default", "second"]
    with pytest.raises(ValueError, match=r"unknown database 'nowhere' \(DATABASES has default, second\)"):
        Pool("eu-proxies", using="nowhere")


def test_the_router_migrates_the_apps_to_every_database_in_use(settings):
    router = routing.LeasesRouter()
    assert router.allow_migrate("second", "leases") is False  # no route names it yet
    settings.LEASES_ROUTES = ROUTES
    assert router.allow_migrate("second", "leases_tasks") and router.allow_migrate("default", "leases")
    assert router.allow_migrate("second", "auth") is None  # other apps: not ours to say
    assert router.db_for_read(Job) == "default" and router.db_for_write(User) is None


# -- every kind, on its database and no other ------------------------------------------


def test_a_routed_pool_lives_on_its_database_and_touches_no_other(routed):
    with statements() as sent:
        eu = Pool("eu-proxies")
        eu.add("p1")
        lease = eu.acquire(ttl=30)
        lease.renew()
        assert eu.stats()["held"] == 1
        lease.release()
        eu.quarantine("p1", 60, "banned")
    assert sent["default"] == [] and len(sent["second"]) > 5
    assert list(Resource.objects.using("second").values_list("pool", "name")) == [("eu-proxies", "p1")]
    assert not Resource.objects.using("default").exists()
    Pool("us-proxies").add("p1")
    assert Resource.objects.using("default").get().pool == "us-proxies"


def test_routed_locks_and_dispatchers_live_on_their_database(routed):
    with statements() as sent:
        with lock("eu:rebuild", ttl=30) as held:
            assert held.using == "second"
        assert acquire_lock("eu:other", ttl=30).token == 1
        assert break_lock("eu:other")
        crawl = Dispatcher("eu-crawl")
        crawl.recreate_task_pool({"a": 1.0, "b": 2.0})
        assert crawl.assign_tasks(2, "w1") == ["a", "b"]
        assert crawl.tasks_done("w1") == 2
    assert sent["default"] == []
    assert set(Lock.objects.using("second").values_list("name", flat=True)) == {
        "eu:rebuild", "eu:other", "dispatch-rebuild:eu-crawl"}  # the rebuild's lock goes with its dispatcher
    assert PoolTask.objects.using("second").count() == 2 and TaskPool.objects.using("second").exists()
    assert not Lock.objects.using("default").exists() and not PoolTask.objects.using("default").exists()


def test_jobs_go_to_their_queues_database_and_a_worker_serves_one(routed):
    with statements() as sent:
        pushed = push("echo", {"n": 1})  # queue "other": routed
        assert pushed._state.db == "second"
        assert push_many([("echo", {"n": 2}), ("echo", {"n": 3})]) == 2
    assert sent["default"] == []
    assert Job.objects.using("second").count() == 3 and Queue.objects.using("second").filter(name="other").exists()
    push("noop", {"n": 4})  # queue "default": not routed
    assert Job.objects.using("default").count() == 1

    with statements() as sent:
        stats = JobWorker(queues=["other"], burst=True, concurrency=2).run()
    assert stats.succeeded == 3 and sent["default"] == []
    assert set(Job.objects.using("second").values_list("status", flat=True)) == {Job.SUCCEEDED}
    assert Job.objects.using("default").get().status == Job.READY  # no worker of its database ran


def test_a_push_many_over_two_databases_splits_by_queue(routed):
    assert push_many([("echo", {"n": 1}), ("noop", {"n": 2}), ("echo", {"n": 3})]) == 3
    assert Job.objects.using("second").count() == 2 and Job.objects.using("default").count() == 1


def test_one_worker_cannot_serve_queues_of_two_databases(routed):
    with pytest.raises(ValueError, match=r"queues live on several databases \(default on default, other on second\)"):
        JobWorker(queues=["default", "other"])
    assert JobWorker(queues=["default", "other"], using="second").using == "second"


def test_a_pipeline_or_schedule_whose_queue_is_routed_elsewhere_is_refused(routed):
    from leases.pipelines import Pipeline, Stage
    from leases.tasks import schedule

    with pytest.raises(ValueError, match="queue 'other' is routed to database 'second', but its jobs would be"):
        Pipeline("split", [Stage("one", ["echo"])]).start()
    with pytest.raises(ValueError, match="schedule: queue 'other' is routed to database 'second'"):
        schedule("tick", "echo", every=60)
    from leases.pipelines.models import Run
    from leases.tasks.models import Schedule

    assert not Run.objects.exists() and not Schedule.objects.exists()


# -- commands ---------------------------------------------------------------------------


def command(manage, env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*manage, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def routed_env(child_env, routed):
    return {**child_env, "LEASES_ROUTES": json.dumps(ROUTES)}


def test_commands_follow_the_routes_and_take_a_database(manage, routed_env):
    assert command(manage, routed_env, "lease", "add", "eu-proxies", "p1").returncode == 0
    assert command(manage, routed_env, "lease", "add", "us-proxies", "p1").returncode == 0
    assert command(manage, routed_env, "lease", "add", "x", "p1", "--database", "second").returncode == 0
    assert sorted(Resource.objects.using("second").values_list("pool", flat=True)) == ["eu-proxies", "x"]
    listing = command(manage, routed_env, "lease", "list").stdout.splitlines()
    assert listing[0].split()[:2] == ["DATABASE", "POOL"]
    assert sorted(line.split()[:2] for line in listing[1:]) == [
        ["default", "us-proxies"], ["second", "eu-proxies"], ["second", "x"]]
    bad = command(manage, routed_env, "lease", "add", "x", "p2", "--database", "nowhere")
    assert bad.returncode == 2 and "unknown database 'nowhere'" in bad.stderr

    push("echo", {"n": 1})
    jobs = command(manage, routed_env, "jobs", "list", "--queue", "other")
    assert jobs.returncode == 0 and "echo" in jobs.stdout
    assert "no jobs" in command(manage, routed_env, "jobs", "list").stdout  # LEASES_DATABASE has none
    assert "echo" in command(manage, routed_env, "jobs", "list", "--database", "second").stdout


def test_one_worker_command_serves_queues_of_both_databases(manage, routed_env):
    push("echo", {"n": 1})
    push("noop", {"n": 2})
    done = command(manage, routed_env, "leases_worker", "--queue", "default,other", "--burst", "--import", "tests.jobs")
    assert done.returncode == 0, done.stderr
    assert Job.objects.using("second").get().status == Job.SUCCEEDED
    assert Job.objects.using("default").get().status == Job.SUCCEEDED
    assert "on default" in done.stderr and "on other" in done.stderr  # each database's worker logged its job


def test_a_worker_on_a_database_that_refuses_it_stops_with_one_line(manage, routed_env):
    env = {**routed_env, "DATABASE_URL_SECOND": routed_env["DATABASE_URL_SECOND"].replace("sqlite:///", "sqlite:////nonexistent/dir/")}
    if "mysql" in env["DATABASE_URL"]:
        env["DATABASE_URL_SECOND"] = env["DATABASE_URL"].replace("mysql://root@", "mysql://nobody-here@")
    if "postgres" in env["DATABASE_URL"]:
        env["DATABASE_URL_SECOND"] = env["DATABASE_URL"].replace("postgres://postgres@", "postgres://nobody-here@")
    done = command(manage, env, "leases_worker", "--queue", "other", "--burst", "--skip-checks")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("CommandError: database 'second' (queues other): ")
    assert done.stderr.strip().count("\n") == 0


def test_prune_deletes_old_finished_jobs_on_every_database_in_use(routed):
    from datetime import timedelta

    from django.core.management import call_command

    from leases.clock import db_now

    push("echo", {"n": 1})
    push("noop", {"n": 2})
    JobWorker(queues=["other"], burst=True).run()
    JobWorker(queues=["default"], burst=True).run()
    for alias in ("default", "second"):
        Job.objects.using(alias).update(finished_at=db_now(alias) - timedelta(days=8))
    call_command("leases_prune", "--older-than", "7d", verbosity=0)
    assert not Job.objects.using("default").exists() and not Job.objects.using("second").exists()


# -- the admin --------------------------------------------------------------------------


def test_each_database_has_an_admin_site_of_its_own(routed, admin_client):
    from django.urls import reverse

    Pool("eu-proxies").add("p1")
    Pool("eu-proxies").acquire(ttl=60)
    Pool("us-proxies").add("p2")
    push("echo", {"n": 1})
    default_page = admin_client.get(reverse("admin:leases_resource_changelist")).content.decode()
    second_page = admin_client.get(reverse("leases_second:leases_resource_changelist")).content.decode()
    assert "us-proxies" in default_page and "eu-proxies" not in default_page
    assert "eu-proxies" in second_page and "us-proxies" not in second_page
    jobs = admin_client.get(reverse("leases_second:leases_tasks_job_changelist"))
    assert jobs.status_code == 200 and "echo" in jobs.content.decode()
    row = Resource.objects.using("second").get()
    response = admin_client.post(reverse("leases_second:leases_resource_changelist"),
                                 {"action": "release_selected", "_selected_action": [row.pk]}, follow=True)
    assert response.status_code == 200 and Pool("eu-proxies").stats()["held"] == 0
    assert LogEntry.objects.filter(object_id=str(row.pk)).exists()  # history is the project's own table


def test_metrics_and_the_dashboard_read_the_database_asked_for(routed, admin_client):
    Pool("eu-proxies").add("p1")
    Pool("us-proxies").add("p2")
    second = admin_client.get("/leases/metrics", {"database": "second"}).content.decode()
    default = admin_client.get("/leases/metrics").content.decode()
    assert 'pool="eu-proxies"' in second and 'pool="us-proxies"' not in second
    assert 'pool="us-proxies"' in default and 'pool="eu-proxies"' not in default
    assert admin_client.get("/leases/metrics", {"database": "nowhere"}).status_code == 400
    page = admin_client.get("/leases/dashboard/", {"database": "second"})
    assert page.status_code == 200 and "eu-proxies" in page.content.decode()
    assert "Leases dashboard of database second" in page.content.decode()
    assert admin_client.get("/leases/dashboard/", {"database": "nowhere"}).status_code == 400
