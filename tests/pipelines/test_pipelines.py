"""Pipelines on the job queue, driven by an in-process burst worker: order, fan-out and
fan-in, failure, cancel, pause/resume, restart, dedupe by key, definition snapshots, what a
handler sees, and bad input. How a run moves on (events, stage ends, the claim's reads,
repairs): test_pipeline_moves. Real processes and SIGKILL: test_pipeline_processes.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
from django.db import connection
from hypothesis import given, settings
from hypothesis import strategies as st

from leases import db
from leases.exceptions import UnknownHandler
from leases.pipelines import Pipeline, Stage, machine, signals
from leases.pipelines.definition import from_snapshot, get, upstream
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks import registry
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from tests import pipes
from tests.pipes import drain, stages

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

EVENT = machine.EVENT


def lines(path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


# -- the happy path ---------------------------------------------------------------------


def test_crawl_runs_stages_in_order_and_hands_results_on(tmp_path):
    log = tmp_path / "runs.log"
    run = pipes.crawl.start(context={"items": 5, "log": str(log)}, key="example.com")
    assert run.created and run.status == Run.RUNNING
    drain()
    run.refresh_from_db()
    assert (run.status, run.error, run.progress()) == (Run.SUCCEEDED, "", (9, 9))
    assert run.live_key is None and run.finished_at >= run.started_at >= run.queued_at
    rows = stages(run)
    assert {name: row.status for name, row in rows.items()} == dict.fromkeys(rows, StageRun.SUCCEEDED)
    assert rows["fetch"].total == 5
    # No task started before every stage it depends on had finished (database clock).
    needs = get("crawl-site").requires()
    for task in TaskRun.objects.filter(run=run):
        for need in needs[task.stage.name]:
            assert task.started_at >= rows[need].finished_at, (task, need)
    index = TaskRun.objects.get(run=run, task="p.index")
    assert index.result == {"fetched": [0, 10, 20, 30, 40], "found": [0, 1, 2, 3, 4]}
    fetched = TaskRun.objects.filter(run=run, task="p.fetch").order_by("position")
    assert [(t.item_index, t.item, t.result) for t in fetched] == [(i, i, i * 10) for i in range(5)]
    ran = lines(log)
    assert sorted(line[1] for line in ran) == sorted(["discover", "thumbs", "transcode", "index"] + ["fetch"] * 5)
    # Each task's job ran once; each stage's end moved the run on in the transaction that
    # recorded its last task (no one else held the run): no advance event was pushed.
    assert not Job.objects.filter(name=EVENT).exists()
    assert not Job.objects.exclude(status=Job.SUCCEEDED).exists()


def test_a_serial_stage_runs_its_tasks_one_after_another_in_order():
    serial = Pipeline("t-serial", [Stage("s", ["p.s1", "p.s2"]), Stage("t", ["p.a1"])])
    run = serial.start(context={"nap": 0.05})
    drain(concurrency=4)
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    s1, s2 = TaskRun.objects.filter(run=run, stage__name="s").order_by("position")
    assert s2.started_at >= s1.finished_at
    assert s2.queued_at >= s1.finished_at  # the second was not even queued before


def test_parallel_tasks_overlap():
    run = pipes.three.start(context={"nap": 0.3})
    drain(concurrency=5)
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    a = list(TaskRun.objects.filter(run=run, stage__name="a"))
    assert max(t.started_at for t in a) < min(t.finished_at for t in a)  # all five ran at once


def test_an_empty_for_each_finishes_its_stage_at_once():
    run = pipes.crawl.start(context={"items": 0})
    drain()
    run.refresh_from_db()
    rows = stages(run)
    assert run.status == Run.SUCCEEDED
    assert (rows["fetch"].status, rows["fetch"].total) == (StageRun.SUCCEEDED, 0)
    assert TaskRun.objects.get(run=run, task="p.index").result == {"fetched": [], "found": []}


def test_max_parallel_bounds_the_queued_tasks_of_a_for_each():
    run = pipes.crawl.start(context={"items": 50})
    assert TaskRun.objects.filter(run=run).count() == 1  # only discover exists yet
    worker = JobWorker(queues=["default"], concurrency=1, burst=True, max_jobs=1, poll=0.01)
    worker.run()  # discover, whose end starts the fetch stage
    fetch = StageRun.objects.get(run=run, name="fetch")
    assert fetch.total == 50
    assert TaskRun.objects.filter(stage=fetch, status=TaskRun.QUEUED).count() == 20
    assert Job.objects.filter(name="p.fetch").count() == 20
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and Job.objects.filter(name="p.fetch").count() == 50


def test_signals_fire_once_per_step_after_commit():
    seen: list[tuple] = []

    def on_task(sender, run, stage, task, **kwargs):
        seen.append(("task", task.task))

    def on_stage(sender, run, stage, **kwargs):
        seen.append(("stage", stage.name, stage.status))

    def on_run(sender, run, **kwargs):
        seen.append(("run", run.status))

    signals.task_finished.connect(on_task)
    signals.stage_finished.connect(on_stage)
    signals.pipeline_finished.connect(on_run)
    try:
        run = pipes.three.start()
        drain()
    finally:
        signals.task_finished.disconnect(on_task)
        signals.stage_finished.disconnect(on_stage)
        signals.pipeline_finished.disconnect(on_run)
    assert sum(1 for item in seen if item[0] == "task") == 15
    assert [item for item in seen if item[0] == "stage"] == [("stage", s, "succeeded") for s in "abc"]
    assert seen[-1] == ("run", "succeeded")
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED


# -- failure ----------------------------------------------------------------------------

failing = Pipeline("t-failing", [
    Stage("first", ["p.a1"]),
    Stage("bad", ["p.fail", "p.b1"], parallel=True),
    Stage("after", ["p.c1"]),
])
going_on = Pipeline("t-going-on", [
    Stage("first", ["p.a2"]),
    Stage("bad", ["p.refuse", "p.b2"], parallel=True, on_failure="continue"),
    Stage("after", ["p.c2"]),
])


def test_a_task_failing_for_good_fails_its_stage_and_the_run(tmp_path):
    log = tmp_path / "runs.log"
    run = failing.start(context={"log": str(log)})
    drain()
    run.refresh_from_db()
    rows = stages(run)
    assert run.status == Run.FAILED and run.live_key is not None  # keyless: no key to free
    assert "stage 'bad' failed: task p.fail failed: RuntimeError: always fails" in run.error
    assert (rows["first"].status, rows["bad"].status, rows["after"].status) == (
        StageRun.SUCCEEDED, StageRun.FAILED, StageRun.CANCELLED,
    )
    fail = TaskRun.objects.get(run=run, task="p.fail")
    assert (fail.status, fail.attempts) == (TaskRun.FAILED, 2)  # the handler's own retries
    assert not TaskRun.objects.filter(run=run, task="p.c1").exists()  # nothing new started
    assert [line[1] for line in lines(log)].count("fail") == 2
    assert "c1" not in {line[1] for line in lines(log)}


def test_on_failure_continue_lets_the_run_go_on():
    run = going_on.start()
    drain()
    run.refresh_from_db()
    rows = stages(run)
    assert run.status == Run.SUCCEEDED
    assert (rows["bad"].status, rows["bad"].failed_tasks) == (StageRun.FAILED, 1)
    assert "Fail: refused" in rows["bad"].error
    assert rows["after"].status == StageRun.SUCCEEDED
    assert TaskRun.objects.get(run=run, task="p.refuse").attempts == 1  # Fail is not retried


def test_a_for_each_result_that_is_not_a_list_fails_the_stage_and_says_why():
    odd = Pipeline("t-not-a-list", [Stage("d", ["p.dict"]), Stage("each", ["p.a3"], for_each="p.dict")])
    run = odd.start()
    drain()
    run.refresh_from_db()
    assert run.status == Run.FAILED
    each = StageRun.objects.get(run=run, name="each")
    assert each.status == StageRun.FAILED
    assert each.error == "for_each task 'p.dict' returned dict, not a list"
    assert "returned dict, not a list" in run.error


# -- operators' events ------------------------------------------------------------------


def test_cancel_stops_the_run_and_running_handlers_see_it(tmp_path):
    watched = Pipeline("t-watched", [Stage("w", ["p.watch", "p.a4"], parallel=True), Stage("x", ["p.a5"])])
    run = watched.start(context={"nap": 30})
    worker = JobWorker(queues=["default"], concurrency=1, poll=0.01)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not Job.objects.filter(name="p.watch", status=Job.RUNNING).exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert run.cancel() is True
        assert run.status == Run.CANCELLED and run.cancel() is False
        # The waiting sibling (one thread only) is cancelled, never run.
        assert Job.objects.get(name="p.a4").status == Job.CANCELLED
        deadline = time.monotonic() + 20
        while TaskRun.objects.filter(run=run, status=TaskRun.QUEUED).exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        worker.stop()
        thread.join(30)
    watch = TaskRun.objects.get(run=run, task="p.watch")
    assert (watch.status, watch.result) == (TaskRun.SUCCEEDED, "saw cancel")  # recorded, moves nothing
    assert TaskRun.objects.get(run=run, task="p.a4").status == TaskRun.CANCELLED
    run.refresh_from_db()
    assert run.status == Run.CANCELLED
    assert {s.status for s in run.stages.all()} == {StageRun.CANCELLED}
    assert not TaskRun.objects.filter(run=run, task="p.a5").exists()


def test_pause_starts_nothing_new_until_resume():
    run = pipes.three.start()
    assert run.pause() is True and run.pause() is False
    drain()  # the first stage's queued tasks run; nothing after them starts
    run.refresh_from_db()
    rows = stages(run)
    assert run.status == Run.PAUSED
    assert rows["a"].pending == 0 and rows["b"].status == StageRun.WAITING
    assert TaskRun.objects.filter(run=run).count() == 5
    assert run.resume() is True and run.resume() is False
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_restart_runs_a_failed_stage_again_and_what_depends_on_it():
    flaky = Pipeline("t-flaky", [Stage("one", ["p.a1"]), Stage("two", ["p.refuse"]), Stage("three", ["p.c3"])])
    run = flaky.start(key="k1")
    drain()
    run.refresh_from_db()
    assert run.status == Run.FAILED and run.live_key is None
    first = TaskRun.objects.get(run=run, task="p.a1")
    with pytest.raises(ValueError, match="only a failed or cancelled stage"):
        run.restart("one")
    with pytest.raises(ValueError, match="has no stage 'nope'"):
        run.restart("nope")
    # The fix is deployed: the stage's task now succeeds (same run, same definition).

    spec = registry.get("p.refuse")
    registry._HANDLERS["p.refuse"] = registry.Handler(name="p.refuse", func=lambda payload: "fixed", backoff=0.0)
    try:
        run.restart("two")
        assert run.status == Run.RUNNING and run.live_key is not None
        drain()
    finally:
        registry._HANDLERS["p.refuse"] = spec
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    assert StageRun.objects.get(run=run, name="two").restarts == 1
    assert TaskRun.objects.get(run=run, task="p.refuse").result == "fixed"
    assert TaskRun.objects.get(run=run, task="p.a1") == first  # earlier results stay
    with pytest.raises(ValueError, match="succeeded: there is nothing to restart"):
        run.restart("two")


def test_restart_of_a_cancelled_run():
    run = pipes.three.start()
    run.cancel()
    run.restart("a")
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED and run.progress() == (15, 15)


def test_restart_of_a_running_stage_is_refused_and_changes_nothing():
    run = pipes.three.start()
    before = list(TaskRun.objects.filter(run=run).values_list("pk", "status", "job_id"))
    with pytest.raises(ValueError, match="stage 'a' of run #\\d+ is running: only a failed or cancelled"):
        run.restart("a")
    assert list(TaskRun.objects.filter(run=run).values_list("pk", "status", "job_id")) == before
    assert StageRun.objects.get(run=run, name="a").restarts == 0


def test_pause_or_resume_of_an_ended_run_is_refused():
    run = pipes.three.start()
    run.cancel()
    for action in (run.pause, run.resume):
        with pytest.raises(ValueError, match="it has cancelled"):
            action()


def test_a_key_has_at_most_one_live_run():
    run = pipes.three.start(key="site-1")
    again = pipes.three.start(key="site-1")
    assert (again.pk, again.created) == (run.pk, False)
    other = pipes.three.start(key="site-2")
    assert other.pk != run.pk
    drain()
    run.refresh_from_db()
    assert run.status == Run.SUCCEEDED
    later = pipes.three.start(key="site-1")  # the key is free once the run ended
    assert later.created and later.pk != run.pk


def test_a_changed_definition_leaves_runs_in_flight_alone():
    first = Pipeline("t-changing", [Stage("one", ["p.a1"]), Stage("two", ["p.a2"])])
    run = first.start()
    Pipeline("t-changing", [Stage("one", ["p.b1"]), Stage("other", ["p.b2"]), Stage("more", ["p.b3"])])
    newer = get("t-changing").start()
    drain()
    run.refresh_from_db()
    newer.refresh_from_db()
    assert run.status == newer.status == Run.SUCCEEDED
    assert sorted(TaskRun.objects.filter(run=run).values_list("task", flat=True)) == ["p.a1", "p.a2"]
    assert sorted(TaskRun.objects.filter(run=newer).values_list("task", flat=True)) == ["p.b1", "p.b2", "p.b3"]



def test_a_handler_sees_context_results_item_run_and_stage():
    seen = {}


    def capture(payload):
        seen.update(payload, results=dict(payload["results"]))

    spec = registry.get("p.c4")
    registry._HANDLERS["p.c4"] = registry.Handler(name="p.c4", func=capture, backoff=0.0)
    try:
        p = Pipeline("t-payload", [
            Stage("d", ["p.discover"]), Stage("f", ["p.fetch"], for_each="p.discover"),
            Stage("last", ["p.c4"], for_each="p.fetch", max_parallel=1),
        ])
        run = p.start(context={"items": 2, "site": "x"})
        drain(concurrency=1)
    finally:
        registry._HANDLERS["p.c4"] = spec
    assert seen == {
        "context": {"items": 2, "site": "x"}, "results": {"p.discover": [0, 1], "p.fetch": [0, 10]},
        "item": 10, "run": run.pk, "stage": "last",
    }
    stored = TaskRun.objects.filter(run=run, task="p.c4").first().job_id
    assert set(Job.objects.get(pk=stored).payload) == {"run", "stage", "task"}  # built when it runs


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("build, message", [
    (lambda: Pipeline("t-bad", [Stage("a", ["p.a1"]), Stage("a", ["p.a2"])]), "two stages are named 'a'"),
    (lambda: Pipeline("t-bad", [Stage("a", ["p.a1"], requires=["b"])]), "requires unknown stage 'b'"),
    (lambda: Pipeline("t-bad", [Stage("a", ["p.a1"], requires=["b"]), Stage("b", ["p.a2"], requires=["a"])]),
     "form a cycle"),
    (lambda: Pipeline("t-bad", [Stage("a", ["p.a1"], requires=["a"])]), "requires itself"),
    (lambda: Pipeline("t-bad", [Stage("a", ["p.discover"]), Stage("b", ["p.a1"], requires=[], for_each="p.discover")]),
     "not a task of a stage it depends on"),
    (lambda: Pipeline("t-bad", [Stage("a", ["p.a1"]), Stage("b", ["p.a1"])]), "task 'p.a1' is in stages"),
    (lambda: Pipeline("t-bad", []), "non-empty list of Stage"),
    (lambda: Stage("a", []), "non-empty list of handler names"),
    (lambda: Stage("a", "p.a1"), "non-empty list of handler names"),
    (lambda: Stage("a", ["p.a1"], max_parallel=0), "max_parallel must be a whole number >= 1"),
    (lambda: Stage("a", ["p.a1"], on_failure="ignore"), "on_failure must be 'fail' or 'continue'"),
    (lambda: Stage(" a", ["p.a1"]), "must not start or end with whitespace"),
    (lambda: Stage("a", ["p.a1\x00"]), "control or invisible characters"),
])
def test_bad_definitions_are_refused_with_one_line(build, message):
    with pytest.raises(ValueError, match=message) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_bad_starts_write_nothing():
    unknown = Pipeline("t-unknown-task", [Stage("a", ["p.a1"]), Stage("b", ["no.such.handler"])])
    with pytest.raises(UnknownHandler, match="no handler named 'no.such.handler'"):
        unknown.start()
    with pytest.raises(ValueError, match="context"):
        pipes.three.start(context={"bad": float("nan")})
    with pytest.raises(ValueError, match="context"):
        pipes.three.start(context={"set": {1, 2}})
    with pytest.raises(ValueError, match="key"):
        pipes.three.start(key="")
    with pytest.raises(ValueError, match="no pipeline named 'nope'"):
        get("nope")
    assert not Run.objects.exists() and not Job.objects.exists()


def test_a_second_module_cannot_take_a_pipeline_name():
    with pytest.raises(ValueError, match="already defined in tests.pipes"):
        Pipeline("crawl-site", [Stage("x", ["p.a1"])], module="elsewhere")


# -- cost ---------------------------------------------------------------------------------


@pytest.mark.skipif("connection.vendor != 'mysql'", reason="ANALYZE checked on MariaDB")
def test_the_engine_reads_tasks_through_indexes():
    """The event's lookup and a stage's next waiting tasks are index reads of a few rows,
    however many tasks the stage has and however far it has got."""
    if not connection.mysql_is_mariadb:
        pytest.skip("ANALYZE SELECT (rows actually read) is MariaDB's")
    run = pipes.crawl.start(context={"items": 3000})
    JobWorker(queues=["default"], concurrency=1, burst=True, max_jobs=2, poll=0.01).run()  # discover + its event
    stage = StageRun.objects.get(run=run, name="fetch")
    TaskRun.objects.filter(stage=stage, status=TaskRun.WAITING, position__lt=2900).update(status=TaskRun.SUCCEEDED)
    job = TaskRun.objects.filter(stage=stage, status=TaskRun.QUEUED).first().job_id
    checks = [
        (TaskRun.objects.filter(job_id=job), "job_id"),
        (TaskRun.objects.filter(stage=stage, status=TaskRun.WAITING).order_by("position")[:20], "leases_pipe_task_next"),
        (TaskRun.objects.filter(stage=stage, status=TaskRun.QUEUED), "leases_pipe_task_next"),
    ]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_pipelines_taskrun")
        cursor.fetchall()
        for queryset, index in checks:
            sql, params = queryset.query.sql_with_params()
            cursor.execute("ANALYZE " + sql, params)  # MariaDB: the plan with rows actually read
            columns = [c[0] for c in cursor.description]
            plan = [dict(zip(columns, row)) for row in cursor.fetchall()]
            assert len(plan) == 1 and plan[0]["key"] == index, plan
            assert plan[0]["type"] in ("ref", "range", "const"), plan
            assert float(plan[0]["r_rows"] or 1) <= 100, plan  # a const read reports none
            assert "filesort" not in (plan[0].get("Extra") or ""), plan


def test_pipeline_task_jobs_carry_their_event():
    run = pipes.three.start()
    job = Job.objects.get(pk=TaskRun.objects.filter(run=run).first().job_id)
    assert (job.backend, job.on_finish, job.queue) == (machine.BACKEND, machine.TASK_ENDED, "default")
    assert json.loads(json.dumps(job.payload))["run"] == run.pk
    assert db.alias() == "default"


# -- bad definitions, as a property ---------------------------------------------------------

NAMES = ["a", "b", "c", "d", " e", "f\x00", ""]
TASKS = ["p.a1", "p.a2", "p.b1", "p.b2", "p.c1", "", "p.c2 "]
stage_specs = st.fixed_dictionaries({
    "name": st.sampled_from(NAMES),
    "tasks": st.one_of(st.lists(st.sampled_from(TASKS), max_size=3), st.sampled_from(["p.a1", None, 3])),
    "requires": st.one_of(st.none(), st.lists(st.sampled_from([*NAMES, "zz"]), max_size=3), st.just("a")),
    "for_each": st.one_of(st.none(), st.sampled_from(TASKS)),
    "parallel": st.sampled_from([False, True, 1]),
    "max_parallel": st.sampled_from([None, 1, 5, 0, -1, True, 2.5]),
    "on_failure": st.sampled_from(["fail", "continue", "skip"]),
})


@st.composite
def plausible(draw) -> list[dict]:
    """Definitions a user might write: sound names and tasks, with requires and for_each
    that may still form a cycle or point outside the stages a stage depends on."""
    names = ["a", "b", "c", "d", "e"][: draw(st.integers(1, 5))]
    tasks = draw(st.permutations(["p.a1", "p.a2", "p.b1", "p.b2", "p.c1"]))
    return [
        {
            "name": name,
            "tasks": [tasks[index]],
            "requires": draw(st.one_of(st.none(), st.lists(st.sampled_from(names), max_size=2, unique=True))),
            "for_each": draw(st.one_of(st.none(), st.sampled_from(tasks[: len(names)]))),
            "parallel": draw(st.booleans()),
        }
        for index, name in enumerate(names)
    ]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.one_of(plausible(), st.lists(stage_specs, max_size=5)))
def test_any_definition_is_either_sound_or_refused_with_one_line(specs):
    try:
        pipeline = Pipeline("t-property", [Stage(**spec) for spec in specs])
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    snapshot = pipeline.snapshot()
    assert from_snapshot(snapshot).snapshot() == snapshot
    requires = pipeline.requires()
    owner = {task: stage.name for stage in pipeline.stages for task in stage.tasks}
    for stage in pipeline.stages:
        assert stage.name not in upstream(stage.name, requires)  # no cycle
        if stage.for_each is not None:
            assert owner[stage.for_each] in upstream(stage.name, requires)
