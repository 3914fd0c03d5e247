"""The pool/bucket dispatcher: seed semantics, bad input, and invariants under processes."""
from __future__ import annotations

import os
import random
import signal
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F

from leases import Locked, lock
from leases.tasks import Dispatcher
from leases.tasks.models import DispatchWorker, PoolTask, TaskPool
from tests.conftest import CONTEXT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def d():
    dispatcher = Dispatcher("crawl")
    dispatcher.recreate_task_pool({f"t{i}": float(i) for i in range(10)})
    return dispatcher


def pool_values(name="crawl"):
    return set(PoolTask.objects.filter(dispatcher=name, state=PoolTask.POOL).values_list("value", flat=True))


# -- seed semantics -----------------------------------------------------------------------


def test_assign_tops_up_lowest_score_first_and_returns_the_same_bucket(d):
    assert d.assign_tasks(3, "w1") == ["t0", "t1", "t2"]
    assert d.assign_tasks(3, "w1") == ["t0", "t1", "t2"]  # exactly `limit`: unchanged
    assert d.assign_tasks(5, "w1") == ["t0", "t1", "t2", "t3", "t4"]
    assert d.assign_tasks(2, "w2") == ["t5", "t6"]
    assert pool_values() == {"t7", "t8", "t9"}


def test_assign_trims_the_excess_from_the_end_back_to_the_pool(d):
    d.assign_tasks(3, "w1")
    d.assign_tasks(5, "w1")  # t3, t4 appended last
    assert d.assign_tasks(2, "w1") == ["t0", "t1"]
    assert pool_values() == {f"t{i}" for i in range(2, 10)}
    assert d.assign_tasks(3, "w2") == ["t2", "t3", "t4"]  # trimmed tasks are handed out again


def test_check_tasks_is_true_for_exactly_the_bucket(d):
    tasks = d.assign_tasks(3, "w1")
    assert d.check_tasks("w1", reversed(tasks))
    assert not d.check_tasks("w1", tasks[:2])
    assert not d.check_tasks("w1", tasks + ["t9"])
    assert not d.check_tasks("w2", tasks)
    assert d.check_tasks("w2", [])


def test_tasks_done_empties_the_bucket_or_removes_some(d):
    tasks = d.assign_tasks(4, "w1")
    d.assign_tasks(2, "w2")
    assert d.tasks_done("w1", tasks[:1] + ["t9", "nonexistent"]) == 1
    assert d.check_tasks("w1", tasks[1:])
    assert d.tasks_done("w1") == 3
    assert d.check_tasks("w1", []) and d.check_tasks("w2", ["t4", "t5"])
    assert d.assign_tasks(10, "w1") == ["t6", "t7", "t8", "t9"]  # done tasks never return
    assert d.stats()["done"] == 4


def test_recreate_leaves_out_bucketed_tasks_and_replaces_the_pool(d):
    d.assign_tasks(2, "w1")  # t0, t1
    listed = d.recreate_task_pool({"t1": 50.0, "t5": -1.0, "new": 0.5})
    assert listed == 3
    assert pool_values() == {"t5", "new"}  # t2..t9 but t5 unlisted: dropped
    assert d.check_tasks("w1", ["t0", "t1"])  # t1 stays in the bucket, not duplicated
    t1 = PoolTask.objects.get(dispatcher="crawl", value="t1")
    assert (t1.state, t1.worker, t1.score) == (PoolTask.BUCKET, "w1", 1.0)
    assert d.assign_tasks(4, "w2") == ["t5", "new"]


def test_a_task_done_while_the_rebuild_reads_its_source_is_not_listed_again(d):
    d.assign_tasks(2, "w1")  # t0, t1
    d.tasks_done("w1", ["t0"])  # done before the rebuild: listing it again re-queues it
    time.sleep(0.005)  # SQLite's clock ticks in ms: "before" must be a distinct instant

    def source():
        snapshot = {f"t{i}": float(i) for i in range(10)}  # still lists t1 ...
        d.tasks_done("w1", ["t1"])  # ... which a worker finishes meanwhile
        return snapshot

    d.recreate_task_pool(source)
    assert "t0" in pool_values()
    assert "t1" not in pool_values()
    assert PoolTask.objects.get(dispatcher="crawl", value="t1").state == PoolTask.DONE


def test_stats_counts_the_pool_and_each_bucket(d):
    d.assign_tasks(3, "w1")
    d.assign_tasks(1, "w2")
    d.tasks_done("w2")
    stats = d.stats()
    assert (stats["pool"], stats["assigned"], stats["done"]) == (6, 3, 1)
    assert stats["workers"]["w1"]["bucket"] == 3 and stats["workers"]["w2"]["bucket"] == 0
    assert set(stats["workers"]["w1"]) == {"bucket", "last_seen"}


def test_only_one_rebuild_runs_at_a_time(d):
    with lock("dispatch-rebuild:crawl", ttl=30):
        with pytest.raises(Locked, match="PROCESSING LOCKED: dispatch-rebuild:crawl"):
            d.recreate_task_pool({"x": 1.0})
    assert "x" not in pool_values()


def test_reclaim_returns_buckets_of_workers_not_seen(d):
    d.assign_tasks(3, "gone")
    d.assign_tasks(2, "alive")
    # "gone" last seen a minute ago, "alive" just now: no race with a busy machine's clock.
    DispatchWorker.objects.filter(name="gone").update(last_seen=F("last_seen") - timedelta(minutes=1))
    d.assign_tasks(2, "alive")  # seen again
    assert d.reclaim(stale_after=30) == 3
    assert pool_values() >= {"t0", "t1", "t2"}
    assert not DispatchWorker.objects.filter(name="gone").exists()
    assert d.check_tasks("alive", ["t3", "t4"])


def test_rebuild_writes_in_batches_and_reports_progress():
    d = Dispatcher("big", batch_size=100)
    seen = []
    assert d.recreate_task_pool({f"u{i}": i % 13 for i in range(1050)}, progress=seen.append) == 1050
    assert seen == [100] * 10 + [50]
    assert len(pool_values("big")) == 1050
    assert TaskPool.objects.get(name="big").rebuilt_at is not None


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"a": 1.0, "b": "high"}, "score of task 'b' must be a finite number"),
        ({"a": float("nan")}, "score of task 'a' must be a finite number"),
        ({"a": True}, "score of task 'a' must be a finite number"),
        ({"": 1.0}, "task must be a non-empty string"),
        ({"x" * 513: 1.0}, "task is longer than 512"),
    ],
)
def test_a_bad_mapping_writes_nothing(d, mapping, message):
    with pytest.raises(ValueError, match=message):
        d.recreate_task_pool(mapping)
    assert pool_values() == {f"t{i}" for i in range(10)}
    assert TaskPool.objects.get(name="crawl").generation == 1  # refused before the rebuild began
    with pytest.raises(ValueError, match=message):
        d.recreate_task_pool(lambda: mapping)  # read once the rebuild has begun
    assert pool_values() == {f"t{i}" for i in range(10)}
    assert TaskPool.objects.get(name="crawl").generation == 2  # the attempt is counted, no more


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Dispatcher(""), "dispatcher name must be a non-empty string"),
        (lambda: Dispatcher("d" * 101), "dispatcher name is longer than 100"),
        (lambda: Dispatcher("crawl").assign_tasks(0, "w"), "limit must be a whole number > 0"),
        (lambda: Dispatcher("crawl").assign_tasks(2.5, "w"), "limit must be a whole number > 0"),
        (lambda: Dispatcher("crawl").assign_tasks(5, ""), "worker name must be a non-empty string"),
        (lambda: Dispatcher("crawl").assign_tasks(5, "w" * 256), "worker name is longer than 255"),
        (lambda: Dispatcher("crawl").tasks_done(""), "worker name must be"),
        (lambda: Dispatcher("crawl").reclaim(0), "stale_after must be a finite number of seconds > 0"),
    ],
)
def test_bad_arguments_are_refused(d, call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert len(pool_values()) == 10 and not DispatchWorker.objects.exists()


def test_the_claim_is_an_index_range_scan_with_many_tasks():
    if connection.vendor != "mysql":
        pytest.skip("EXPLAIN checked on MySQL/MariaDB")
    Dispatcher("other", batch_size=2000).recreate_task_pool({f"o{i}": i for i in range(5000)})
    Dispatcher("crawl").recreate_task_pool({f"c{i}": i for i in range(50)})
    with connection.cursor() as cursor:
        cursor.execute(
            "EXPLAIN SELECT id, value FROM leases_tasks_pooltask WHERE dispatcher = %s AND state = 0"
            " ORDER BY score, id LIMIT 100", ["crawl"])
        columns = [c[0] for c in cursor.description]
        plan = dict(zip(columns, cursor.fetchone()))
    assert plan["key"] == "leases_tasks_task_claim"
    assert "filesort" not in (plan["Extra"] or "")


# -- processes --------------------------------------------------------------------------------


def _work(name, worker, done, guard, rebuilding, out):
    d = Dispatcher(name)
    rounds = idle = 0
    while idle < 3:
        tasks = d.assign_tasks(random.randint(5, 40), worker)
        if tasks and random.random() < 0.3:
            tasks = d.assign_tasks(random.randint(1, 4), worker)  # trims the rest back
        if not tasks:
            idle += 0 if rebuilding.is_set() else 1
            time.sleep(0.05)
            continue
        idle = 0
        assert d.check_tasks(worker, tasks)
        with guard:  # record before telling the dispatcher, as a real worker would
            for task in tasks:
                done[task] = done.get(task, 0) + 1
        if random.random() < 0.5:
            assert d.tasks_done(worker) == len(tasks)
        else:
            assert d.tasks_done(worker, tasks) == len(tasks)
        rounds += 1
    out.put(rounds)


def _rebuild(name, everything, done, rebuilding, times):
    d = Dispatcher(name, batch_size=200)
    try:
        for _ in range(times):
            d.recreate_task_pool(lambda: {t: random.random() for t in everything if t not in dict(done.items())})
            time.sleep(0.2)
    finally:
        rebuilding.clear()


@pytest.mark.slow
def test_every_task_is_done_exactly_once_while_eight_workers_race_a_rebuilder(processes, queue):
    everything = [f"task-{i}" for i in range(1500)]
    d = Dispatcher("race", batch_size=500)
    d.recreate_task_pool({t: random.random() for t in everything[:750]})  # half now, all later
    manager = CONTEXT.Manager()
    try:
        done, guard, rebuilding = manager.dict(), manager.Lock(), CONTEXT.Event()
        rebuilding.set()
        processes.start(_rebuild, "race", everything, done, rebuilding, 4)
        for i in range(8):
            processes.start(_work, "race", f"worker-{i}", done, guard, rebuilding, queue)
        rounds = [queue.get(timeout=180) for _ in range(8)]
        processes.join_all()
        counts = dict(done.items())
    finally:
        manager.shutdown()
    assert sum(rounds) > 50
    assert sorted(counts) == sorted(everything), "tasks lost"
    duplicated = {t: n for t, n in counts.items() if n != 1}
    assert not duplicated, f"tasks done more than once: {list(duplicated.items())[:5]}"
    assert PoolTask.objects.filter(dispatcher="race").exclude(state=PoolTask.DONE).count() == 0


def _take_and_die(name, out):
    out.put(Dispatcher(name).assign_tasks(4, "doomed"))
    out.close()
    out.join_thread()  # the report is flushed before the process dies
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_sigkilled_workers_bucket_goes_to_another_worker(d, processes, queue):
    processes.start(_take_and_die, "crawl", queue)
    lost = queue.get(timeout=30)
    processes.join_all()
    survivor = Dispatcher("crawl", stale_after=1.0)
    assert survivor.assign_tasks(10, "survivor") == [f"t{i}" for i in range(4, 10)]
    time.sleep(1.3)
    assert sorted(survivor.assign_tasks(10, "survivor")) == sorted(lost + [f"t{i}" for i in range(4, 10)])
