"""Jobs that hold resources, in one process: a job of a handler with `lease=` is claimed
only with a lease on a qualifying free resource, its handler sees the lease, its end
releases it (after the cool-down), a ban keeps that resource from that target only, a
pace spaces starts per (resource, target), an affinity key keeps its jobs on one
resource, targets take turns, and a job that finds no resource waits in the database
without holding up the others."""
from __future__ import annotations

from datetime import timedelta

import pytest

from leases import Pool, targets
from leases.clock import db_now
from leases.models import Resource, ResourceTarget
from leases.tasks import Needs, handler, push, push_many
from leases.tasks.models import Affinity, Job, PoolTurn
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

SEEN: list[dict] = []


def domain(payload):
    return payload["site"]


@handler("lease.fetch", queue="crawl", lease=Needs("proxies", target=domain), backoff=0.0)
def fetch(payload, ctx):
    SEEN.append({"n": payload["n"], "name": ctx.lease.name, "token": ctx.lease.token, "target": ctx.target})
    if payload.get("ban"):
        ctx.ban("403 here", seconds=600)
    if payload.get("rest"):
        ctx.rest(300)
    return ctx.lease.name


@handler("lease.eu", queue="crawl", lease=Needs("proxies", where={"region": "eu"}))
def fetch_eu(payload, ctx):
    SEEN.append({"n": payload["n"], "name": ctx.lease.name})


@handler("lease.paced", queue="crawl", lease=Needs("proxies", target=domain, pace=60))
def paced(payload, ctx):
    SEEN.append({"n": payload["n"], "name": ctx.lease.name})


@handler("lease.session", queue="crawl", lease=Needs("accounts", affinity=lambda payload: payload["session"]))
def session(payload, ctx):
    SEEN.append({"n": payload["n"], "name": ctx.lease.name})


@handler("lease.plain", queue="crawl")
def plain(payload):
    SEEN.append({"n": payload["n"], "name": None})


@pytest.fixture(autouse=True)
def fresh():
    SEEN.clear()
    yield
    SEEN.clear()


def worker(**options) -> JobWorker:
    found = JobWorker(queues=["crawl"], ttl=30, **options)
    found.register()
    return found


def drain(**options) -> None:
    JobWorker(queues=["crawl"], burst=True, poll=0.01, **options).run()


def held() -> list[Resource]:
    return [r for r in Resource.objects.all() if r.state_at(db_now()) == Resource.HELD]


def test_a_job_is_claimed_with_a_lease_and_its_end_releases_it():
    Pool("proxies").add_many([("p1", None), ("p2", None)])
    jobs = [push("lease.fetch", {"n": n, "site": "a.example"}).pk for n in range(3)]
    w = worker(concurrency=3)
    claimed = w.claim(3)
    assert len(claimed) == 2  # two resources: the third job waits, ready, holding nothing
    assert {job.lease.name for job in claimed} == {"p1", "p2"}
    rows = {row.pk: row for row in Job.objects.filter(pk__in=jobs)}
    for job in claimed:
        row, resource = rows[job.id], Resource.objects.get(pk=job.lease.id)
        assert (row.status, row.resource_id, row.lease_token) == (Job.RUNNING, resource.pk, resource.token)
        assert resource.busy_before == row.expires_at or abs((resource.busy_before - row.expires_at).total_seconds()) < 1
    waiting = [pk for pk in jobs if pk not in {job.id for job in claimed}]
    assert Job.objects.get(pk=waiting[0]).status == Job.READY and Job.objects.get(pk=waiting[0]).attempt == 0
    w.hand_back()
    assert not held()
    drain()
    assert Job.objects.filter(status=Job.SUCCEEDED).count() == 3 and not held()
    leases = [(entry["name"], entry["token"]) for entry in SEEN]
    assert len(set(leases)) == 3  # each attempt's lease has a token of its own (tokens grow per resource)


def test_plain_jobs_and_other_pools_never_wait_behind_a_pool_without_resources():
    Pool("proxies").add("p1")
    Pool("proxies").quarantine("p1", seconds=600)
    push_many([("lease.fetch", {"n": n, "site": "a.example"}) for n in range(50)])
    plain_ids = [push("lease.plain", {"n": n}).pk for n in range(5)]
    drain(concurrency=4)
    assert Job.objects.filter(pk__in=plain_ids, status=Job.SUCCEEDED).count() == 5
    assert Job.objects.filter(name="lease.fetch", status=Job.READY, attempt=0).count() == 50


def test_a_ban_keeps_the_resource_from_its_target_only_and_spends_no_attempt():
    Pool("proxies").add_many([("p1", None), ("p2", None)])
    job = push("lease.fetch", {"n": 1, "site": "a.example", "ban": True})
    w = worker(concurrency=1)
    (first,) = w.claim(1)
    banned = first.lease.name
    w.running[first.id] = first
    from leases.tasks.worker.threads import execute
    outcome = execute(first)
    w.finish([outcome])
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt) == (Job.READY, 0)  # back, no try used
    state = ResourceTarget.objects.get(pool="proxies", name=banned, target="a.example")
    assert state.state_at(db_now()) == "banned" and state.ban_reason == "403 here"
    assert not held()
    Job.objects.filter(pk=job.pk).update(payload={"n": 1, "site": "a.example"})
    (second,) = w.claim(1)
    assert second.lease.name != banned  # the next run is on another resource
    w.hand_back()
    other = push("lease.fetch", {"n": 2, "site": "b.example"})
    Pool("proxies").quarantine("p1" if banned == "p2" else "p2", seconds=60)  # only the banned one is left
    (third,) = w.claim(1)
    assert (third.id, third.lease.name) == (other.pk, banned)  # other targets still use it
    w.hand_back()


def test_a_target_refusing_every_slot_the_claim_reads_first_still_gets_a_free_one_beyond():
    from leases.tasks.jobs.leasing import FREE_READ

    Pool("proxies").add_many([(f"p{n:03d}", None) for n in range(FREE_READ + 6)])
    Resource.objects.filter(name__gte=f"p{FREE_READ:03d}").update(busy_before=db_now())  # freed last
    for n in range(FREE_READ):  # a.example bans every slot the claim reads first
        targets.ban("proxies", f"p{n:03d}", "a.example", 600)
    push_many([("lease.fetch", {"n": 1, "site": "b.example"}), ("lease.fetch", {"n": 2, "site": "a.example"})])
    w = worker(concurrency=2)
    got = {job.target: job.lease.name for job in w.claim(2)}
    assert got["b.example"] == "p000" and got["a.example"] >= f"p{FREE_READ:03d}", got
    w.hand_back()


def test_a_claim_of_many_targets_reads_the_free_slots_once(monkeypatch):
    from leases import db

    Pool("proxies").add_many([(f"p{n}", None) for n in range(40)])
    push_many([("lease.fetch", {"n": n, "site": f"s{n}.example"}) for n in range(16)])
    targets.ban("proxies", "p0", "s0.example", 600)
    w = worker(concurrency=16)
    statements, execute = [], db.Cursor.execute

    def counting(cursor, sql, params=()):
        statements.append(sql)
        return execute(cursor, sql, params)

    monkeypatch.setattr(db.Cursor, "execute", counting)
    claimed = w.claim(16)
    monkeypatch.undo()
    assert len(claimed) == 16 and len({job.lease.name for job in claimed}) == 16
    assert next(job.lease.name for job in claimed if job.target == "s0.example") != "p0"
    reads = [sql for sql in statements if "ORDER BY busy_before" in sql]
    assert len(reads) == 1, reads  # not a read per target
    w.hand_back()


def test_a_rest_rests_the_resource_for_its_target_after_the_job():
    Pool("proxies").add("p1")
    push("lease.fetch", {"n": 1, "site": "a.example", "rest": True})
    drain()
    found = targets.unusable_now("proxies", "a.example", ["p1"])
    assert found["p1"].why == "rested"
    assert not targets.unusable_now("proxies", "b.example", ["p1"])
    assert targets.lift("proxies", "p1") == [("p1", "a.example")]
    assert not targets.unusable_now("proxies", "a.example", ["p1"])


def test_resources_that_do_not_qualify_are_not_handed_out():
    Pool("proxies").add_many([("us-1", {"region": "us"}), ("eu-1", {"region": "eu"}), ("us-2", {"region": "us"})])
    push_many([("lease.eu", {"n": n}) for n in range(3)])
    w = worker(concurrency=3)
    claimed = w.claim(3)
    assert [job.lease.name for job in claimed] == ["eu-1"]
    w.hand_back()
    drain()
    assert {entry["name"] for entry in SEEN} == {"eu-1"} and len(SEEN) == 3


def test_a_pace_spaces_the_starts_of_a_resource_for_a_target():
    Pool("proxies").add_many([("p1", None), ("p2", None)])
    push_many([("lease.paced", {"n": n, "site": "a.example"}) for n in range(3)]
              + [("lease.paced", {"n": 9, "site": "b.example"})])
    drain(concurrency=4)
    # One start a minute per proxy for a.example: two of its jobs ran, on two proxies; b's ran.
    ran = {entry["n"]: entry["name"] for entry in SEEN}
    assert len([n for n in ran if n < 9]) == 2 and len({ran[n] for n in ran if n < 9}) == 2 and 9 in ran
    assert Job.objects.filter(status=Job.READY).count() == 1


def test_an_affinity_key_keeps_its_jobs_on_the_resource_it_last_used():
    Pool("accounts").add_many([(f"acct-{n}", None) for n in range(4)])
    push("lease.session", {"n": 0, "session": "alice"})
    drain()
    first = SEEN[0]["name"]
    assert Affinity.objects.get(pool="accounts", affinity="alice").name == first
    push_many([("lease.session", {"n": n, "session": "alice"}) for n in range(1, 6)])
    drain(concurrency=4)
    assert {entry["name"] for entry in SEEN} == {first}  # one at a time, all on alice's account
    Pool("accounts").quarantine(first, seconds=60)  # no longer usable: the key moves on
    push("lease.session", {"n": 9, "session": "alice"})
    drain()
    assert SEEN[-1]["name"] != first


def test_targets_take_turns_when_resources_are_scarce():
    Pool("proxies").add("p1")
    push_many([("lease.fetch", {"n": n, "site": "a.example"}) for n in range(40)])
    push_many([("lease.fetch", {"n": 100 + n, "site": "b.example"}) for n in range(3)])
    assert PoolTurn.objects.get(pool="proxies", target="a.example").last_turn == 40
    order = []
    w = worker(concurrency=1)
    for _ in range(8):
        (job,) = w.claim(1)
        order.append(job.target)
        w.running[job.id] = job
        from leases.tasks.jobs.outcomes import Outcome
        w.finish([Outcome(job, ok=True)])
        w.running.clear()
    assert order[:2] == ["a.example", "b.example"] and order.count("b.example") == 3  # b did not wait for a's 40


def test_a_lost_lease_is_seen_by_the_heartbeat():
    Pool("proxies").add("p1")
    push("lease.fetch", {"n": 1, "site": "a.example"})
    w = worker(concurrency=1)
    (job,) = w.claim(1)
    w.running[job.id] = job
    Pool("proxies").release("p1")  # an operator frees it
    w.heartbeat()
    assert job.lease.lost
    w.hand_back()


def test_a_bad_key_function_fails_the_push_in_one_line_and_writes_nothing():
    with pytest.raises(ValueError, match="^lease target function failed for this payload: KeyError"):
        push("lease.fetch", {"n": 1})
    with pytest.raises(ValueError, match="^lease target function returned a bad key"):
        push("lease.fetch", {"n": 1, "site": 42})
    assert not Job.objects.exists()
    for bad, words in [({"pace": "fast"}, "rate must be"), ({"ban_for": -1}, "ban_for"), ({"where": ["x"]}, "where")]:
        with pytest.raises(ValueError, match=words):
            Needs("proxies", **bad)


def test_expired_leases_free_the_resource_and_recovery_puts_the_job_back():
    Pool("proxies").add("p1")
    job = push("lease.fetch", {"n": 1, "site": "a.example"})
    w = worker(concurrency=1)
    w.claim(1)
    Job.objects.filter(pk=job.pk).update(expires_at=db_now() - timedelta(seconds=1))
    Resource.objects.filter(pool="proxies").update(busy_before=db_now() - timedelta(seconds=1))
    other = worker(concurrency=1)
    assert other.recover() == 1
    (again,) = other.claim(1)
    assert again.id == job.pk and again.lease.name == "p1"
    other.hand_back()


def test_a_pipelines_tasks_a_schedules_jobs_and_a_django_task_hold_leases_too():
    """The one maker of job rows applies `lease=` whoever enqueues."""
    import tests.pipes as pipes
    from leases.tasks import schedule
    from leases.tasks.models import Schedule
    from leases.tasks.schedules import fire_due
    from tests import tasks_demo

    Pool("pipepool").add_many([("q1", None), ("q2", None)])
    run = pipes.leased_fan.start(context={"items": [{"site": "a"}, {"site": "b"}, {"site": "a"}]})
    JobWorker(queues=["default"], burst=True, poll=0.01).run()
    tasks = Job.objects.filter(name="p.leased")
    assert tasks.count() == 3 and set(tasks.values_list("pool", flat=True)) == {"pipepool"}
    assert sorted(tasks.values_list("target", flat=True)) == ["a", "a", "b"]
    assert {result[0] for result in tasks.values_list("result", flat=True)} <= {"q1", "q2"}
    run.refresh_from_db()
    assert run.status == run.SUCCEEDED

    Pool("proxies").add("p1")
    schedule("leased-tick", "lease.fetch", every=60, payload={"n": 7, "site": "tick.example"})
    Schedule.objects.filter(name="leased-tick").update(next_fire_at=db_now() - timedelta(seconds=1))
    assert fire_due() == 1
    tick = Job.objects.get(name="lease.fetch")
    assert (tick.pool, tick.target) == ("proxies", "tick.example")

    result = tasks_demo.leased_call.enqueue("shop.example")
    task_job = Job.objects.get(pk=int(result.id))
    assert (task_job.pool, task_job.target) == ("proxies", "shop.example")
    drain(concurrency=2)
    JobWorker(queues=["default"], burst=True, poll=0.01, concurrency=2).run()
    assert Job.objects.get(pk=task_job.pk).result == "p1" and not held()


def test_a_pools_lane_and_a_targets_free_slots_are_index_range_reads_on_mysql():
    from django.db import connection

    from leases.sql import statements

    if connection.vendor != "mysql":
        pytest.skip("EXPLAIN checked on MySQL/MariaDB (PostgreSQL's in test_plans_postgres.py)")
    push_many([("lease.fetch", {"n": n, "site": f"s{n % 20}"}) for n in range(3000)])
    Pool("proxies").add_many([(f"r{n}", None) for n in range(3000)])
    until = db_now() + timedelta(minutes=10)
    ResourceTarget.objects.bulk_create([
        ResourceTarget(pool=pool, name=f"r{n}", target=f"s{n % 20}", banned_until=until, updated_at=until)
        for pool in ("proxies", "other") for n in range(0, 3000, 3)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_tasks_job, leases_resource, leases_resourcetarget")
        cursor.fetchall()
        for sql, params, index in [(statements(connection, "job").due, ["crawl", "proxies", 10], "leases_job_claim"),
                                   (statements(connection, "leasing").free_for, ["proxies", "proxies", "s1", 64],
                                    "leases_resource_free"),
                                   (statements(connection, "leasing").free, ["proxies", 64], "leases_resource_free"),
                                   (statements(connection, "leasing").refused + "%s, %s) AND name IN (%s, %s)",
                                    ["proxies", "s1", "s2", "r1", "r2"], "leases_resource_target")]:
            cursor.execute("EXPLAIN " + sql.replace(" FOR UPDATE SKIP LOCKED", ""), params)
            columns = [c[0] for c in cursor.description]
            first, *rest = [dict(zip(columns, row)) for row in cursor.fetchall()]
            # The refusals of a few resources for a few targets: either index reads a few rows.
            assert first["key"] in {index, "leases_target_of_resource"}, first
            assert "filesort" not in (first["Extra"] or ""), first
            # A target's refusals, probed per slot or read for its pool and target only (MariaDB
            # turns NOT EXISTS into a materialized IN): never every refusal of every pool.
            for step in (first, *rest):
                assert step["type"] != "ALL", step
