"""The delayed job queue in one process: seed semantics, bad input, fencing, history."""
from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from django.db import connection, transaction

import tests.jobs  # noqa: F401 - registers the handlers
from leases.clock import db_now
from leases.exceptions import QueueFull, UnknownHandler
from leases.tasks import push, push_many, registry
from leases.tasks import queue as jobqueue
from leases.tasks.jobs.outcomes import Outcome
from leases.tasks.models import Job, JobError, Queue
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

READY, RUNNING, SUCCEEDED, FAILED, DEAD, CANCELLED = range(6)


def worker(**options) -> JobWorker:
    w = JobWorker(**{"queues": ["default"], "concurrency": 4, "ttl": 5, "burst": True, **options})
    w.register()
    return w


def make_due(*jobs: Job) -> None:
    Job.objects.filter(pk__in=[j.pk for j in jobs]).update(run_at=db_now() - timedelta(seconds=1))


# -- push -------------------------------------------------------------------------------


def test_push_returns_the_waiting_job_with_server_time():
    before = db_now()
    job = push("noop", {"n": 1}, delay=30, priority=5)
    after = db_now()
    row = Job.objects.get()
    assert (job.pk, job.status, job.priority, job.queue, job.max_attempts) == (row.pk, READY, 5, "default", 3)
    assert before + timedelta(seconds=29.9) <= row.run_at <= after + timedelta(seconds=30.1)
    assert row.enqueued_at <= row.run_at and row.payload == {"n": 1}
    assert Queue.objects.filter(name="default").exists()  # made on first push, for the admin


@pytest.mark.parametrize(
    "args, kwargs, error",
    [
        (("nope", {}), {}, UnknownHandler),
        (("noop", {"x": object()}), {}, ValueError),
        (("noop", {"x": float("nan")}), {}, ValueError),
        (("noop", {}), {"delay": -1}, ValueError),
        (("noop", {}), {"priority": 101}, ValueError),
        (("noop", {}), {"priority": True}, ValueError),
        (("noop", {}), {"queue": "a,b"}, ValueError),
        (("noop", {}), {"key": ""}, ValueError),
        (("noop", {}), {"delay": 1, "run_at": "tomorrow"}, ValueError),
        (("noop", {}), {"max_attempts": 0}, ValueError),
    ],
)
def test_bad_push_raises_and_writes_nothing(args, kwargs, error):
    with pytest.raises(error):
        push(*args, **kwargs)
    assert not Job.objects.exists()


def test_push_many_validates_every_item_before_writing():
    items = [("noop", {"n": i}) for i in range(5)] + [("noop", {"n": object()})]
    with pytest.raises(ValueError, match="item 5"):
        push_many(items)
    assert not Job.objects.exists()
    assert push_many([("noop", {"n": i}) for i in range(2500)] + [("echo", {}, {"priority": 3})]) == 2501
    assert Job.objects.count() == 2501
    assert Job.objects.get(name="echo").queue == "other"


def test_same_name_and_payload_is_one_job_whose_run_time_moves():
    first = push("noop", {"n": 1}, delay=60)
    again = push("noop", {"n": 1})
    assert again.pk == first.pk and Job.objects.count() == 1
    assert Job.objects.get().run_at < first.run_at  # moved earlier...
    push("noop", {"n": 1}, delay=120)
    assert Job.objects.get().run_at > first.run_at  # ...and later: the seed's reschedule
    push("noop", {"n": 2})
    push("noop", {"n": 3}, key="mine")
    push("noop", {"n": 4}, key="mine")
    assert Job.objects.count() == 3
    assert push_many([("noop", {"n": 1}), ("noop", {"n": 1})]) == 2
    assert Job.objects.count() == 3


def test_a_key_is_free_again_once_its_job_started():
    job = push("noop", {"n": 1})
    w = worker()
    assert [j.id for j in w.claim(5)] == [job.pk]
    assert push("noop", {"n": 1}).pk != job.pk
    assert Job.objects.count() == 2


def test_push_in_a_transaction_is_undone_with_it():
    with pytest.raises(RuntimeError), transaction.atomic():
        push("noop", {"n": 1})
        assert Job.objects.count() == 1
        raise RuntimeError
    assert not Job.objects.exists()


def test_push_in_a_transaction_is_invisible_to_others_until_commit(child_env, manage):
    count = [*manage, "shell", "-c", "from leases.tasks.models import Job; print(Job.objects.count())"]
    with transaction.atomic():
        push("noop", {"n": 1})
        seen = subprocess.run(count, env=child_env, capture_output=True, text=True, timeout=60)
        assert seen.stdout.split()[-1] == "0", seen.stderr
    seen = subprocess.run(count, env=child_env, capture_output=True, text=True, timeout=60)
    assert seen.stdout.split()[-1] == "1", seen.stderr


# -- claims -----------------------------------------------------------------------------


def test_claims_take_priority_first_then_run_time_and_skip_future_jobs():
    low = push("noop", {"n": "low"}, priority=-5)
    old = push("noop", {"n": "old"})
    new = push("noop", {"n": "new"})
    high = push("noop", {"n": "high"}, priority=10)
    later = push("noop", {"n": "later"}, delay=60, priority=100)
    Job.objects.filter(pk=old.pk).update(run_at=db_now() - timedelta(seconds=5))
    w = worker()
    claimed = w.claim(10)
    assert [j.id for j in claimed] == [high.pk, old.pk, new.pk, low.pk]
    assert all(j.attempt == 1 for j in claimed)
    row = Job.objects.get(pk=high.pk)
    assert (row.status, row.worker, row.attempt, row.pending_key) == (RUNNING, w.name, 1, None)
    assert row.expires_at > row.started_at
    assert Job.objects.get(pk=later.pk).status == READY


def test_claim_takes_at_most_the_free_slots_across_queues():
    for i in range(5):
        push("noop", {"n": i})
        push("echo", {"n": i})
    w = worker(queues=["default", "other"])
    assert len(w.claim(3)) == 3
    assert Job.objects.filter(status=RUNNING).count() == 3


def test_a_paused_queue_is_not_claimed():
    push("noop", {"n": 1})
    push("echo", {"n": 1})
    Queue.objects.filter(name="default").update(paused=True)
    w = worker(queues=["*"])
    assert [j.name for j in w.claim(5)] == ["echo"]


# -- running ----------------------------------------------------------------------------


def test_burst_worker_runs_everything_and_keeps_results():
    push("echo", {"a": 1})
    push_many([("noop", {"n": i}) for i in range(50)])
    stats = worker(queues=["default", "other"]).run()
    assert stats.succeeded == 51
    assert set(Job.objects.values_list("status", flat=True)) == {SUCCEEDED}
    echo = Job.objects.get(name="echo")
    assert echo.result == {"echo": {"a": 1}} and echo.finished_at >= echo.started_at
    assert not Job.objects.filter(expires_at__isnull=False).exists()


def test_failures_retry_until_dead_with_one_error_per_attempt():
    job = push("boom", {"n": 7})
    worker().run()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt) == (DEAD, 3)
    errors = list(JobError.objects.filter(job=row).values_list("attempt", "exception", "message"))
    assert errors == [(i, "builtins.RuntimeError", "boom 7") for i in (1, 2, 3)]
    assert "RuntimeError: boom 7" in JobError.objects.first().traceback


def test_retry_waits_for_its_backoff_and_a_burst_worker_leaves_a_distant_one():
    @registry.handler("flaky-backoff", backoff=200.0, max_attempts=2)
    def flaky(payload):
        raise ValueError("not yet")

    job = push("flaky-backoff", {})
    w = worker()
    w.run()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt) == (READY, 1)
    assert row.run_at - db_now() > timedelta(seconds=90)  # equal jitter: 100 s to 200 s


def test_a_burst_worker_stays_for_a_retry_due_within_a_minute():
    @registry.handler("flaky-once", backoff=0.5, max_attempts=3)
    def flaky_once(payload):
        if not JobError.objects.filter(job_id=payload["id"]).exists():
            raise ValueError("first try fails")
        return "second try"

    job = push("flaky-once", {"id": 0})
    Job.objects.filter(pk=job.pk).update(payload={"id": job.pk})
    stats = worker().run()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt, row.result) == (SUCCEEDED, 2, "second try")
    assert (stats.failed, stats.succeeded) == (1, 1)


def test_fail_stops_retries_and_timeout_fails_the_attempt():
    refused = push("refuse", {})
    slow = push("slow", {"seconds": 1.5})
    worker().run()
    assert Job.objects.get(pk=refused.pk).status == FAILED
    assert JobError.objects.filter(job_id=refused.pk).count() == 1
    row = Job.objects.get(pk=slow.pk)
    assert (row.status, row.attempt) == (DEAD, 2)
    assert set(JobError.objects.filter(job=row).values_list("exception", flat=True)) == {"builtins.TimeoutError"}


def test_a_job_whose_handler_this_worker_lacks_goes_back_then_fails_after_the_grace(settings):
    job = push("noop", {})
    Job.objects.filter(pk=job.pk).update(name="deployed-elsewhere")
    stats = worker().run()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempt, row.claims, row.worker) == (READY, 0, 1, "")  # the try given back
    assert row.run_at > db_now() + timedelta(seconds=5) and row.bounced_at is not None
    assert stats.bounced == 1 and not JobError.objects.exists()
    settings.LEASES_HANDLER_GRACE = 0.5
    Job.objects.filter(pk=job.pk).update(run_at=db_now(), bounced_at=db_now() - timedelta(seconds=1))
    worker().run()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.claims) == (FAILED, 2)
    assert JobError.objects.get(job_id=job.pk).exception == "leases.exceptions.UnknownHandler"


# -- crashes and fencing ----------------------------------------------------------------


def expire_leases() -> None:
    Job.objects.filter(status=RUNNING).update(expires_at=db_now() - timedelta(seconds=1))


def test_a_recovered_attempt_cannot_overwrite_the_next_one():
    job = push("noop", {"n": 1})
    a, b = worker(), worker()
    (first,) = a.claim(1)
    expire_leases()  # a stopped heartbeating
    assert b.recover() == 1
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.worker, row.attempt) == (READY, "", 1)
    assert JobError.objects.get(job=row).exception == "leases.exceptions.WorkerLost"
    (second,) = b.claim(1)
    assert second.attempt == 2
    b.finish([Outcome(second, ok=True, result='"second"')])
    a.finish([Outcome(first, ok=True, result='"late"')])
    a.finish([Outcome(first, ok=False, error=("x.Late", "late", ""), delay=0)])
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.result, row.attempt) == (SUCCEEDED, "second", 2)
    assert JobError.objects.filter(job=row).count() == 1


def test_recovery_with_no_attempt_left_makes_the_job_dead():
    job = push("echo", {})  # max_attempts=1
    a, b = worker(queues=["other"]), worker(queues=["other"])
    a.claim(1)
    expire_leases()
    assert b.recover() == 1
    row = Job.objects.get(pk=job.pk)
    assert row.status == DEAD and row.finished_at is not None


def test_heartbeat_extends_running_jobs_and_readopts_after_a_lapse():
    job = push("noop", {})
    w = worker()
    w.running = {j.id: j for j in w.claim(1)}
    expire_leases()
    w.hold.renew()  # still held: only the job's lease lapsed
    w.heartbeat()
    assert Job.objects.get(pk=job.pk).expires_at > db_now()
    old = w.name
    from leases.tasks.models import Worker as WorkerRow

    WorkerRow.objects.filter(name=old).update(expires_at=db_now() - timedelta(seconds=1))
    w.heartbeat()  # its own lease lapsed: a new name, and the job it still runs is adopted
    assert w.name != old
    assert Job.objects.get(pk=job.pk).worker == w.name


def test_hand_back_returns_unfinished_jobs_without_using_up_a_try():
    job = push("noop", {})
    w = worker()
    w.running = {j.id: j for j in w.claim(1)}
    assert w.hand_back() == 1
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.worker, row.attempt, row.max_attempts, row.claims) == (READY, "", 0, 3, 1)


# -- bounded queues ---------------------------------------------------------------------


def test_a_full_queue_rejects_new_jobs_but_still_reschedules_waiting_ones():
    Queue.objects.create(name="default", max_length=2)
    push("noop", {"n": 1}, delay=60)
    push("noop", {"n": 2})
    with pytest.raises(QueueFull, match="default"):
        push("noop", {"n": 3})
    with pytest.raises(QueueFull):
        push_many([("noop", {"n": 4})])
    assert Job.objects.count() == 2
    moved = push("noop", {"n": 1})
    assert moved.run_at < db_now() + timedelta(seconds=5)


# -- operators and history --------------------------------------------------------------


def test_cancel_retry_and_discard():
    waiting = push("noop", {"n": 1})
    running = push("noop", {"n": 2})
    Job.objects.filter(pk=waiting.pk).update(run_at=db_now() + timedelta(hours=1))
    worker().claim(1)
    assert jobqueue.cancel([waiting.pk, running.pk]) == 2  # the running one is asked to stop
    assert Job.objects.get(pk=waiting.pk).status == CANCELLED
    row = Job.objects.get(pk=running.pk)
    assert (row.status, row.cancel_requested_at is not None) == (RUNNING, True)  # its worker ends it
    assert jobqueue.cancel([running.pk], running=False) == 0
    assert jobqueue.retry([waiting.pk, running.pk]) == 1
    row = Job.objects.get(pk=waiting.pk)
    assert (row.status, row.attempt, row.max_attempts) == (READY, 0, 3)  # the tries it had left
    assert jobqueue.discard([waiting.pk, running.pk]) == 1
    assert list(Job.objects.values_list("pk", flat=True)) == [running.pk]


def test_prune_deletes_only_old_finished_jobs_with_their_errors(capsys):
    push("boom", {"n": 1})
    push("noop", {"n": 2})
    worker().run()
    push("noop", {"n": 3})  # waiting: never pruned
    Job.objects.filter(status__in=[SUCCEEDED, DEAD]).update(finished_at=db_now() - timedelta(days=8))
    push("echo", {})
    worker(queues=["other"]).run()  # finished just now: kept
    from django.core.management import call_command

    call_command("leases_prune", "--older-than", "7d", "--batch-size", "1")
    assert "deleted 2 finished jobs" in capsys.readouterr().out
    assert sorted(Job.objects.values_list("name", flat=True)) == ["echo", "noop"]
    assert not JobError.objects.exists()


def test_prune_deletes_workers_gone_longer_than_the_cutoff(capsys):
    from django.core.management import call_command

    from leases.tasks.models import Worker as WorkerRow

    now = db_now()
    for name, gone in (("stopped-long-ago", timedelta(days=8)), ("stopped-today", timedelta(hours=1)),
                       ("alive", -timedelta(seconds=30))):
        WorkerRow.objects.create(name=name, holder="" if gone.total_seconds() > 0 else "h", queues="default",
                                 concurrency=1, started_at=now - timedelta(days=9), heartbeat_at=now - gone,
                                 expires_at=now - gone)
    call_command("leases_prune", "--older-than", "7d")
    assert "deleted 0 finished jobs, 1 stopped workers and 0 targets' past bans, rests and paces older than 7d" in (
        capsys.readouterr().out)
    assert sorted(WorkerRow.objects.values_list("name", flat=True)) == ["alive", "stopped-today"]


def test_prune_command_refuses_bad_durations(manage, child_env):
    result = subprocess.run([*manage, "leases_prune", "--older-than", "soon"], env=child_env, capture_output=True, text=True)
    assert result.returncode == 2 and "not a duration" in result.stderr
    bare = subprocess.run([*manage, "leases_prune", "--older-than", "7"], env=child_env, capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.strip().endswith("--older-than: '7' needs a unit: 7s, 7m, 7h or 7d?")


def test_only_the_last_runs_of_a_key_are_kept(settings):
    settings.LEASES_KEEP_RUNS = 3
    for n in range(5):
        push("noop", {"n": n}, key="nightly")
        worker().run()
    push("noop", {"n": 9}, key="other")
    worker().run()
    kept = list(Job.objects.filter(key="nightly").order_by("pk").values_list("payload", flat=True))
    assert kept == [{"n": 2}, {"n": 3}, {"n": 4}]
    assert Job.objects.filter(key="other").count() == 1


def test_the_claim_is_an_index_range_scan_beside_finished_rows():
    if connection.vendor != "mysql":
        pytest.skip("EXPLAIN checked on MySQL/MariaDB")
    push_many([("noop", {"n": i}) for i in range(5000)])
    Job.objects.update(status=SUCCEEDED, finished_at=db_now(), pending_key=None)
    push_many([("noop", {"n": i}) for i in range(50)])
    from leases.sql import statements

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_tasks_job")
        cursor.fetchall()
        cursor.execute("EXPLAIN " + statements(connection, "job").due, ["default", "", 10])
        columns = [c[0] for c in cursor.description]
        plan = dict(zip(columns, cursor.fetchone()))
    assert plan["key"] == "leases_job_claim", plan
    assert "filesort" not in (plan["Extra"] or ""), plan


def test_a_claim_looks_up_its_own_jobs_only_after_one_that_may_have_committed_unseen(monkeypatch):
    from leases import db
    from leases.sql import statements

    push_many([("noop", {"n": n}) for n in range(4)])
    w = worker()
    sent: list[str] = []
    execute = db.Cursor.execute
    monkeypatch.setattr(db.Cursor, "execute", lambda self, sql, params=(): (sent.append(sql), execute(self, sql, params))[1])
    mine = statements(connection, "job").running_for
    assert len(w.claim(2)) == 2 and mine not in sent  # the usual claim: no extra statement
    w._claim_unsure = True  # the last claim's reply was lost
    found = w.claim(2)
    assert mine in sent and len(found) == 2 and not w._claim_unsure
    assert {job.claims for job in found} == {1}


def test_push_many_stores_every_field_of_every_job():
    """One batch of every kind of job (PostgreSQL writes it as one array per column):
    delays, a run time, limits, NULLs, text that needs quoting, and a key met twice."""
    at = db_now() + timedelta(seconds=90)
    odd = 'quote " backslash \\ braces {a,b} comma, NULL é ☃'
    items = [
        ("noop", {"n": 1}, {"delay": 30, "priority": 5}),
        ("noop", {"n": 2}, {"run_at": at, "key": "k2"}),
        ("noop", {"n": 3}, {"limit_key": "site", "concurrency": 2, "rate": "5/s", "max_attempts": 4}),
        ("noop", {"n": 4}, {"queue": "other"}),
        ("noop", {"n": 5, "s": odd}, {}),
        ("noop", {"n": 6}, {"key": "k2", "priority": 9}),  # merges into n=2: the latest run time wins
    ]
    before = db_now()
    assert push_many(items) == 6
    jobs = {job.payload["n"]: job for job in Job.objects.all()}
    assert sorted(jobs) == [1, 2, 3, 4, 5]
    assert jobs[1].priority == 5 and timedelta(seconds=29) < jobs[1].run_at - before < timedelta(seconds=31)
    assert (jobs[2].key, jobs[2].pushes, jobs[2].priority) == ("k2", 2, 9)
    assert jobs[2].run_at - before < timedelta(seconds=5)
    assert (jobs[3].limit_key, jobs[3].concurrency, jobs[3].rate, jobs[3].max_attempts) == ("site", 2, "5/s", 4)
    assert jobs[1].concurrency is None and jobs[1].limit_key == "" and jobs[1].traceparent is None
    assert (jobs[4].queue, jobs[5].payload["s"]) == ("other", odd)
    assert {job.status for job in jobs.values()} == {Job.READY}
