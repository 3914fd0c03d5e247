"""The job queue, the dispatcher and push() through real faults: replies lost after
COMMIT, refused connections, a stalled server, all injected by tests/faultproxy.py
between real worker processes and MariaDB. No worker may die of one, every job runs, and
nothing is left ready or running. (Leases and `lease run`: test_lease_faults.py.)

In-process tests use a second database alias, "proxied": the test database reached
through the proxy.
"""
from __future__ import annotations

import time

import pytest
from django.db import OperationalError, connection, connections

import tests.jobs  # noqa: F401 - registers noop
from leases import db
from leases.clock import db_now
from leases.sql import statements
from leases.tasks import Dispatcher, push, push_many
from leases.tasks.models import Job, PoolTask
from leases.tasks.worker import JobWorker
from tests.conftest import CONTEXT, wait_for
from tests.helpers import drain_and_check, log_lines, pickup_seconds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

READY, RUNNING, SUCCEEDED = 0, 1, 2
COMMIT = r"^\s*COMMIT\b"


@pytest.fixture(autouse=True)
def a_server_behind_the_proxy():
    if connection.vendor == "sqlite":
        pytest.skip("the fault-injection proxy stands in front of a server")


@pytest.fixture
def workers(proxied_workers):
    """Every worker process of this module reaches the database through the proxy."""
    return proxied_workers


# -- in one process ---------------------------------------------------------------------------


def test_a_lost_commit_reply_is_djangos_error_never_the_drivers(proxy, proxied):
    """Closing the cursor after a failed COMMIT raised the driver's own error, which
    replaced Django's and escaped every `except DatabaseError`."""
    driver = connections["default"].Database  # MySQLdb or psycopg

    def work(cursor, resumed):
        with db.write_transaction(proxied):
            cursor.execute(statements(cursor.db, "clock").now, ())

    proxy.drop_reply(COMMIT, count=1)
    with pytest.raises(OperationalError) as caught:
        db.run(work, proxied, attempts=1)
    assert not isinstance(caught.value, driver.Error)
    assert db.transient(caught.value)
    db.run(work, proxied)  # and the next unit of work reconnects


def test_a_push_whose_commit_reply_was_lost_is_found_not_pushed_twice(proxy, proxied):
    # What commits a push: its one statement where an INSERT returns columns, else a COMMIT.
    one_statement = connections[proxied].features.can_return_columns_from_insert
    rule = proxy.drop_reply(r'^\s*INSERT INTO [`"]?leases_tasks_job\b' if one_statement else COMMIT, count=1)
    job = push("noop", {"n": 1}, using=proxied)
    assert rule.dropped == 1
    row = Job.objects.get()
    assert (job.pk, job.pushes, job.merged) == (row.pk, 1, False) and row.pushes == 1


def test_push_many_and_the_dispatcher_ride_out_lost_replies(proxy, proxied):
    rule = proxy.drop_reply(COMMIT, probability=0.5, seed=7)
    assert push_many([("noop", {"n": n}) for n in range(50)], using=proxied) == 50
    assert Job.objects.count() == 50  # a batch whose COMMIT reply was lost is found, not written again
    assert set(Job.objects.values_list("pushes", flat=True)) == {1}
    Dispatcher("faulty").recreate_task_pool({f"t{n}": float(n) for n in range(40)})
    dispatcher = Dispatcher("faulty", using=proxied)
    buckets = [dispatcher.assign_tasks(5, f"w{n}") for n in range(8)]
    assert rule.dropped >= 2
    handed = [task for bucket in buckets for task in bucket]
    assert len(handed) == 40 and len(set(handed)) == 40
    assert PoolTask.objects.filter(dispatcher="faulty", state=PoolTask.BUCKET).count() == 40


def test_the_heartbeat_extends_only_the_jobs_the_worker_runs():
    a = JobWorker(queues=["default"], ttl=5)
    a.register()
    jobs = [push("noop", {"n": n}) for n in range(2)]
    first, orphan = sorted(a.claim(2), key=lambda job: job.id)
    a.running = {first.id: first}  # the orphan's claim reply was "lost"
    Job.objects.filter(status=RUNNING).update(expires_at=db_now())
    a.heartbeat()
    assert Job.objects.get(pk=first.id).expires_at > db_now()
    assert Job.objects.get(pk=orphan.id).expires_at <= db_now()
    b = JobWorker(queues=["default"], ttl=5)
    b.register()
    assert b.recover() == 1  # the orphan goes back; the job a runs stays a's
    assert Job.objects.get(pk=orphan.id).status == READY
    assert Job.objects.get(pk=first.id).status == RUNNING
    assert len(jobs) == 2


def test_a_graceful_stop_hands_back_claims_whose_reply_was_lost():
    w = JobWorker(queues=["default"], ttl=5)
    w.register()
    push_many([("noop", {"n": n}) for n in range(3)])
    claimed = w.claim(3)
    w.running = {claimed[0].id: claimed[0]}
    w._claim_unsure = True  # the claim's reply was lost; the other two are unknown here
    assert w.hand_back() == 3
    assert set(Job.objects.values_list("status", "attempt", "claims")) == {(READY, 0, 1)}


# -- lease holders through the proxy ------------------------------------------------------------


def _hold_through(port, seconds, occupancy, lock, out):
    """Acquire, use while surely held, release: through the proxy, counting holders."""
    from leases import NoResourceAvailable, Pool

    connections["default"].settings_dict.update(HOST="127.0.0.1", PORT=port)
    names, got, overlaps, errors = ["r0", "r1", "r2"], [], 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            lease = Pool("faulty").acquire(ttl=2, wait=1)
        except NoResourceAvailable:
            continue
        except OperationalError:
            errors += 1  # every retry lost its reply: the lease, if any, lapses by itself
            continue
        i = names.index(lease.name)
        with lock:
            occupancy[i] += 1
            overlaps += occupancy[i] > 1 and lease.remaining() > 0
        time.sleep(0.002)
        with lock:
            occupancy[i] -= 1
        try:
            lease.release()
        except OperationalError:
            errors += 1
        got.append((lease.name, lease.token))
    out.put((got, overlaps, errors))


def test_leases_stay_exclusive_by_token_through_lost_replies(proxy, processes, queue):
    from leases import Pool
    from leases.models import Resource

    Pool("faulty").add_many([(name, None) for name in ("r0", "r1", "r2")])
    lost = proxy.drop_reply(r"^UPDATE \S+ SET busy_before", probability=0.05, seed=3)
    occupancy, lock = CONTEXT.Array("i", 3), CONTEXT.Lock()
    for _ in range(6):
        processes.start(_hold_through, proxy.port, 4.0, occupancy, lock, queue)
    results = [queue.get(timeout=90) for _ in range(6)]
    processes.join_all()
    held = [pair for got, _, _ in results for pair in got]
    assert sum(overlaps for _, overlaps, _ in results) == 0
    assert len(held) > 100 and lost.dropped >= 5
    assert len(held) == len(set(held)), "a (resource, token) pair was handed out twice"
    for name in ("r0", "r1", "r2"):
        tokens = sorted(token for n, token in held if n == name)
        assert tokens and tokens[-1] <= Resource.objects.get(pool="faulty", name=name).token


# -- worker processes through the proxy -------------------------------------------------------


def test_workers_survive_lost_commit_replies_and_every_job_runs(workers, proxy, tmp_path):
    log = tmp_path / "runs.log"
    total = 600
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(total)])
    commits = proxy.drop_reply(COMMIT, probability=0.03, seed=11)
    beats = proxy.drop_reply(r"^UPDATE \S+ SET expires_at", probability=0.5, count=4, seed=12)  # a drain lasts few beats
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--ttl", "2") for _ in range(3)]
    runs = drain_and_check(workers, procs, log, total)
    assert commits.dropped >= 3 and beats.dropped >= 1
    doubles = sum(count - 1 for count in runs.values())
    # A job runs twice only when a reply was lost with the outcome of its first run
    # unknown for longer than the ttl; each drop explains at most one.
    assert doubles <= commits.dropped + beats.dropped


def test_a_claim_whose_commit_reply_was_lost_is_run_once_by_the_worker_that_made_it(workers, proxy, tmp_path):
    log = tmp_path / "runs.log"
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(6)])
    rule = proxy.drop_reply(COMMIT, count=1, after=r"SET status = 1, attempt = attempt \+ 1")  # the claim's
    proc = workers.start("--burst", "--queue", "default", "--concurrency", "4")
    assert workers.wait(proc, 60) == 0, workers.stderr(proc)
    assert rule.dropped == 1
    assert "took back 4 job(s)" in workers.stderr(proc)
    assert set(Job.objects.values_list("status", "attempt", "claims")) == {(SUCCEEDED, 1, 1)}
    assert sorted(n for n, _ in log_lines(log)) == list(range(6))


@pytest.mark.parametrize(
    "fault, seconds",
    [
        ("refuse", 12),  # longer than db.run's own retries (at most 9 s) and than the ttl
        ("stall", 6),  # past the workers' read timeout (3 s) and their ttl
    ],
)
def test_workers_ride_out_an_outage_longer_than_their_ttl(workers, proxy, tmp_path, fault, seconds):
    log = tmp_path / "runs.log"
    total = 300
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(total)])
    procs = [workers.start("--queue", "default", "--concurrency", "4", "--ttl", "2") for _ in range(2)]
    # Both at work before the fault: one still starting up would wait for the database as
    # a starting worker does (CI's load once slowed one that far), not in its loop.
    wait_for(lambda: Job.objects.filter(status=SUCCEEDED).count() >= 50
             and len(set(Job.objects.filter(status=SUCCEEDED).values_list("worker", flat=True))) == 2,
             30, "both workers to drain")
    getattr(proxy, fault)(seconds)
    time.sleep(seconds + 0.5)
    runs = drain_and_check(workers, procs, log, total)
    if fault == "refuse":  # longer than db.run retries: the loop itself waited it out
        quiet = [workers.stderr(proc) for proc in procs if "database error" not in workers.stderr(proc)]
        assert not quiet, quiet
    assert sum(runs.values()) - total <= 2 * 4  # at most what was running when it began


def test_a_worker_started_during_an_outage_waits_for_the_database(workers, proxy, tmp_path):
    """The soak found replacements started mid-outage exiting 75 on their queue check."""
    log = tmp_path / "runs.log"
    push_many([("noop", {"n": n, "log": str(log)}) for n in range(20)])
    proxy.refuse(8)
    proc = workers.start("--queue", "default", "--ttl", "2")
    time.sleep(6)
    assert proc.poll() is None, workers.stderr(proc)
    assert "waiting to start" in workers.stderr(proc)
    drain_and_check(workers, [proc], log, 20, timeout=60)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's")
def test_a_lost_listen_connection_is_said_once_and_the_worker_listens_again(workers, proxy, tmp_path):
    """Polls every 5 s, so a pickup under half a second after the outage needs the listen
    connection back; a refusal of several reconnects is one line, not one per try."""
    proc = workers.start("--queue", "default", "--poll", "5")
    wait_for(lambda: "listening for pushes (LISTEN" in workers.stderr(proc), 20, "the worker to listen")
    proxy.refuse(3)
    time.sleep(3.5)
    wait_for(lambda: "listening for pushes again" in workers.stderr(proc), 20, "the worker to listen again")
    assert workers.stderr(proc).count("lost its listen connection") == 1, workers.stderr(proc)
    time.sleep(1.5)  # past the poll it made when it listened again
    assert pickup_seconds(push("noop", {"n": 1}).pk) < 0.5
    assert proc.poll() is None and "Traceback" not in workers.stderr(proc), workers.stderr(proc)
