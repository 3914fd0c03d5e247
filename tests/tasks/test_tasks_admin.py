"""The dispatcher admin: counts without N+1 queries, buckets by the database clock, reclaim."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import leases.ops.adminkit
from leases.clock import db_now
from leases.tasks import Dispatcher
from leases.tasks.models import DispatchWorker, PoolTask, TaskPool
from tests.helpers import table

pytestmark = pytest.mark.django_db(transaction=True)

DISPATCHERS = reverse("admin:leases_tasks_taskpool_changelist")
WORKERS = reverse("admin:leases_tasks_dispatchworker_changelist")
TASKS = reverse("admin:leases_tasks_pooltask_changelist")





def counts(row: dict) -> tuple:
    return tuple(int(row[c]) for c in ("pool_size", "assigned", "done", "workers"))


@pytest.fixture
def crawl():
    """crawl: t0..t9; w1 holds t0 t1 (t2 done), w2 holds t3 t4; five left in the pool."""
    d = Dispatcher("crawl")
    d.recreate_task_pool({f"t{i}": float(i) for i in range(10)})
    d.assign_tasks(3, "w1")
    d.tasks_done("w1", ["t2"])
    d.assign_tasks(2, "w2")
    return d


@pytest.fixture
def index():
    """index: i0..i3; its own w1 holds i0, the rest in the pool."""
    d = Dispatcher("index")
    d.recreate_task_pool({f"i{i}": float(i) for i in range(4)})
    d.assign_tasks(1, "w1")
    return d


def test_dispatcher_changelist_counts_tasks_by_state_and_workers(admin_client, crawl, index):
    rows = table(admin_client.get(DISPATCHERS), "name")
    assert {name: counts(row) for name, row in rows.items()} == {
        "crawl": (5, 4, 1, 2),
        "index": (3, 1, 0, 1),
    }
    assert rows["crawl"]["generation"] == "1"
    assert rows["crawl"]["rebuilt"] != "-"

    by_pool_size = admin_client.get(DISPATCHERS, {"o": "2"})  # pool size (column 0 is the checkbox)
    assert list(table(by_pool_size, "name")) == ["index", "crawl"]


def test_dispatcher_changelist_queries_do_not_grow_with_dispatchers(admin_client):
    def page(expected_rows: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            rows = table(admin_client.get(DISPATCHERS), "name")
        assert len(rows) == expected_rows
        assert all(counts(row) == (2, 1, 0, 1) for row in rows.values())
        return len(queries)

    def dispatchers(first: int, last: int) -> None:
        for n in range(first, last):
            d = Dispatcher(f"d{n}")
            d.recreate_task_pool({"a": 1.0, "b": 2.0, "c": 3.0})
            d.assign_tasks(1, "w")

    dispatchers(0, 2)
    two = page(2)
    dispatchers(2, 10)
    assert page(10) == two


def test_workers_changelist_shows_bucket_sizes_and_filters_by_dispatcher(admin_client, crawl, index):
    rows = table(admin_client.get(WORKERS), "dispatcher", "name")
    # w1 of crawl and w1 of index are different workers: the count joins on both names.
    assert {key: int(row["bucket_size"]) for key, row in rows.items()} == {
        ("crawl", "w1"): 2,
        ("crawl", "w2"): 2,
        ("index", "w1"): 1,
    }
    assert all(0 <= int(row["seen_ago"]) <= 60 for row in rows.values())

    response = admin_client.get(WORKERS, {"dispatcher": "index"})
    assert list(table(response, "dispatcher", "name")) == [("index", "w1")]
    assert "?dispatcher=crawl" in response.content.decode()  # the filter offers each one
    assert list(table(admin_client.get(WORKERS, {"q": "w2"}), "dispatcher", "name")) == [("crawl", "w2")]


def test_workers_seconds_since_seen_are_by_the_database_clock(admin_client, crawl, monkeypatch):
    real, reads = leases.ops.adminkit.db_now, []
    monkeypatch.setattr(leases.ops.adminkit, "db_now",
                        lambda using=None: reads.append(1) or real(using) + timedelta(hours=1))
    rows = table(admin_client.get(WORKERS), "name")
    assert all(3600 <= int(row["seen_ago"]) <= 3660 for row in rows.values())
    assert len(reads) == 1  # one reading for the whole page


def test_workers_changelist_queries_do_not_grow_with_workers(admin_client, crawl):
    def page(expected_rows: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert len(table(admin_client.get(WORKERS), "name")) == expected_rows
        return len(queries)

    two = page(2)
    for n in range(3, 8):
        crawl.assign_tasks(1, f"w{n}")
    assert page(7) == two


def test_reclaim_action_returns_stale_workers_buckets_of_the_selected_dispatchers(admin_client, crawl, index):
    an_hour_ago = db_now() - timedelta(hours=1)
    DispatchWorker.objects.filter(name="w1").update(last_seen=an_hour_ago)  # in both dispatchers
    selected = TaskPool.objects.get(name="crawl").pk
    response = admin_client.post(
        DISPATCHERS, {"action": "reclaim_selected", "_selected_action": [selected]}, follow=True
    )
    assert [str(m) for m in response.context["messages"]] == [
        "2 tasks of stale workers back in the pool of 1 dispatcher."
    ]
    assert crawl.bucket("w1") == [] and crawl.bucket("w2") == ["t3", "t4"]
    assert index.bucket("w1") == ["i0"]  # not selected: untouched
    assert counts(table(response, "name")["crawl"]) == (7, 2, 1, 1)  # w1 forgotten too


def test_tasks_changelist_lists_filters_by_state_and_dispatcher(admin_client, crawl, index):
    everything = table(admin_client.get(TASKS), "value")
    # The claim index's order: by dispatcher, then pool, buckets, done, each by score.
    assert list(everything) == [*(f"t{i}" for i in (5, 6, 7, 8, 9, 0, 1, 3, 4, 2)), "i1", "i2", "i3", "i0"]
    assert everything["t3"]["state"] == "bucket" and everything["t3"]["worker"] == "w2"
    assert everything["t3"]["assigned"] != "-" and everything["t2"]["done"] != "-"

    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(TASKS, {"state": PoolTask.BUCKET})
    assert list(table(response, "value")) == ["t0", "t1", "t3", "t4", "i0"]
    sql = [q["sql"].upper() for q in queries]
    assert sum("COUNT(" in q for q in sql) == 1  # the unfiltered total is not counted
    # The dispatcher filter offers each dispatcher without a DISTINCT over all the tasks.
    assert "?dispatcher=index" in response.content.decode()
    assert not any("DISTINCT" in q for q in sql)

    done = admin_client.get(TASKS, {"dispatcher": "crawl", "state": PoolTask.DONE})
    assert list(table(done, "value")) == ["t2"]
    assert list(table(admin_client.get(TASKS, {"q": "i"}), "value")) == ["i1", "i2", "i3", "i0"]
    assert table(admin_client.get(TASKS, {"q": "1"}), "value") == {}  # a prefix, not a substring


def test_nothing_is_added_changed_or_deleted_and_viewers_cannot_reclaim(client, admin_client, crawl):
    pk = TaskPool.objects.get(name="crawl").pk
    for model in ("taskpool", "dispatchworker", "pooltask"):
        assert admin_client.get(reverse(f"admin:leases_tasks_{model}_add")).status_code == 403
    objects = {"taskpool": pk, "dispatchworker": DispatchWorker.objects.get(name="w1").pk,
               "pooltask": PoolTask.objects.get(value="t0").pk}
    for model, obj in objects.items():
        detail = admin_client.get(reverse(f"admin:leases_tasks_{model}_change", args=[obj]))
        assert detail.status_code == 200 and not detail.context["has_change_permission"]
        assert not detail.context["adminform"].form.fields
    page = admin_client.get(reverse("admin:leases_tasks_taskpool_change", args=[pk])).content.decode()
    readonly = r'field-(pool_size|assigned|done|workers)\b.*?<div class="readonly">(\d+)<'
    assert re.findall(readonly, page, re.S) == [
        ("pool_size", "5"), ("assigned", "4"), ("done", "1"), ("workers", "2")
    ]
    assert admin_client.post(reverse("admin:leases_tasks_taskpool_delete", args=[pk])).status_code == 403
    actions = dict(admin_client.get(DISPATCHERS).context["action_form"].fields["action"].choices)
    assert set(actions) - {""} == {"reclaim_selected"}

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_taskpool"))
    client.force_login(viewer)
    response = client.get(DISPATCHERS)
    assert counts(table(response, "name")["crawl"]) == (5, 4, 1, 2)
    assert response.context["action_form"] is None
