"""`manage.py pipeline`: operator subcommands in process, exit codes through real
subprocesses. Runs are driven by an in-process burst worker (tests.pipes' handlers)."""
from __future__ import annotations

import io
import re
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import CommandError, call_command

import tests.pipes  # registers crawl-site, three-by-five and the p.* handlers
from leases.management.text import span
from leases.pipelines import Pipeline, Stage, store
from leases.pipelines.management.commands.pipeline import bar
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.pipelines.runs import prune
from leases.tasks import queue as jobqueue
from leases.tasks.models import Job
from leases.tasks.worker import JobWorker
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

FAILING = Pipeline("cmd-failing", [Stage("first", ["p.a1"]), Stage("second", ["p.fail"]), Stage("third", ["p.a2"])])
FANOUT = Pipeline("cmd-fanout", [
    Stage("discover", ["p.discover"]),
    Stage("each", ["p.a3"], for_each="p.discover", on_failure="continue"),
])
WATCHED = Pipeline("cmd-watched", [Stage("w", ["p.watch"])])
WATCHERS = Pipeline("cmd-watchers", [
    Stage("discover", ["p.discover"]),
    Stage("each", ["p.watch"], for_each="p.discover", on_failure="continue"),
])
BROKEN = Pipeline("cmd-broken", [Stage("x", ["p.nope"])])  # handlers are checked at start

BAR = re.compile(r"\|([ #]{60})\|$")


def pipeline(*args: str) -> tuple[str, str]:
    """Run `pipeline ARGS` in process; its stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    call_command("pipeline", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def fails(code: int, *args: str) -> str:
    """The one-line error of `pipeline ARGS`, which must exit with `code`."""
    with pytest.raises(CommandError) as info:
        pipeline(*args)
    assert info.value.returncode == code, str(info.value)
    assert "\n" not in str(info.value)
    return str(info.value)


def drain(max_jobs: int | None = None) -> None:
    JobWorker(queues=["default"], concurrency=1 if max_jobs else 4, burst=True, poll=0.01, max_jobs=max_jobs).run()


def everything() -> list:
    """Every row the command could write, to show a refusal wrote nothing."""
    return [
        list(model.objects.order_by("pk").values())
        for model in (Run, StageRun, TaskRun, Job)
    ]


def section(text: str, heading: str) -> list[str]:
    """The lines of `text` after the line starting with `heading`, up to a blank line."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(heading)) + 1
    end = next((i for i in range(first, len(lines)) if not lines[i].strip()), len(lines))
    return lines[first:end]


def columns(line: str) -> list[str]:
    return line.split()


# -- start ------------------------------------------------------------------------------


def test_start_prints_the_run_id_alone_and_a_live_key_says_so_on_stderr():
    out, err = pipeline("start", "crawl-site", "--key", "example.com", "--context", '{"items": 2}')
    run = Run.objects.get()
    assert (out, err) == (f"{run.pk}\n", "")
    assert (run.pipeline, run.key, run.context, run.status) == ("crawl-site", "example.com", {"items": 2}, Run.RUNNING)
    again, said = pipeline("start", "crawl-site", "--key", "example.com", "--import", "tests.pipes")
    assert again == out
    assert said == f"run #{run.pk} of key example.com is already live\n"
    assert Run.objects.count() == 1
    other, _ = pipeline("start", "crawl-site")
    assert int(other) != run.pk and Run.objects.count() == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (("start", "no-such"), "no pipeline named 'no-such' (known: "),
        (("start", "crawl-site", "--context", "{bad"), "--context is not valid JSON"),
        (("start", "crawl-site", "--key", ""), "key must be a non-empty string"),
        (("start", "cmd-broken"), "pipeline 'cmd-broken': no handler named 'p.nope'"),
        (("start", "crawl-site", "--import", "tests.no_such_module"), "--import tests.no_such_module: ModuleNotFoundError"),
    ],
)
def test_start_refuses_bad_input_with_one_line_and_writes_nothing(args, message):
    pipeline("start", "three-by-five")
    before = everything()
    assert message in fails(2, *args)
    assert everything() == before


# -- list -------------------------------------------------------------------------------


def test_list_shows_runs_newest_first_and_filters():
    done = tests.pipes.crawl.start()
    drain()
    live = tests.pipes.three.start()
    stopped = tests.pipes.crawl.start(key="k1")
    stopped.cancel()
    out, _ = pipeline("list")
    header, *rows = out.splitlines()
    assert columns(header) == ["ID", "PIPELINE", "KEY", "STATUS", "PROGRESS", "STARTED", "DURATION"]
    assert [columns(row)[0] for row in rows] == [str(stopped.pk), str(live.pk), str(done.pk)]
    first, second, third = (columns(row) for row in rows)
    assert first[1:5] == ["crawl-site", "k1", "cancelled", "1/1"]  # its task, cancelled, has finished
    assert second[1:4] == ["three-by-five", "running", "0/5"]  # no key: the column is blank
    assert third[1:4] == ["crawl-site", "succeeded", "7/7"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \d+(ms|\.\ds)", " ".join(third[4:]))

    def ids(*args: str) -> list[str]:
        return [columns(row)[0] for row in pipeline("list", *args)[0].splitlines()[1:]]

    assert ids("--status", "succeeded") == [str(done.pk)]
    assert ids("--name", "crawl-site") == [str(stopped.pk), str(done.pk)]
    assert ids("--name", "crawl-site", "--status", "running") == []
    assert ids("--limit", "2") == [str(stopped.pk), str(live.pk)]
    assert "--status must be one of running, paused" in fails(2, "list", "--status", "done")
    assert "--limit must be a whole number from 1 to 10000, not '0'" in fails(2, "list", "--limit", "0")
    assert "--limit must be a whole number from 1 to 10000, not 'many'" in fails(2, "list", "--limit", "many")
    assert "--limit must be a whole number from 1 to 10000" in fails(2, "list", "--limit", "10001")
    assert pipeline("list", "--status", "paused") == ("no runs\n", "")


def test_list_and_show_say_how_many_tasks_failed():
    run = FANOUT.start(context={"items": 6})
    drain(max_jobs=2)  # p.discover, then its event: six tasks queued
    each = StageRun.objects.get(run=run, name="each")
    doomed = list(TaskRun.objects.filter(stage=each, item_index__in=[1, 4]).values_list("job_id", flat=True))
    assert jobqueue.discard(doomed) == 2  # their tasks are recorded as failed
    drain()
    failed = FAILING.start()
    drain()
    listed = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line) for line in pipeline("list")[0].splitlines()[1:]}
    # on_failure="continue": the run went on, and its progress says two tasks failed.
    assert listed[str(run.pk)][1:4] == ["cmd-fanout", "succeeded", "7/7 (2 failed)"]
    assert listed[str(failed.pk)][1:4] == ["cmd-failing", "failed", "2/2 (1 failed)"]
    out, _ = pipeline("show", str(run.pk))
    assert re.search(r"^progress +7/7 tasks done \(2 failed\)$", out, re.MULTILINE)
    stages = {columns(line)[0]: re.split(r"\s{2,}", line) for line in section(out, "STAGE")}
    assert stages["discover"][1:3] == ["succeeded", "1/1"] and stages["each"][1:3] == ["failed", "6/6 (2 failed)"]
    assert re.search(r"^progress +2/2 tasks done \(1 failed\)$", pipeline("show", str(failed.pk))[0], re.MULTILINE)


# -- show -------------------------------------------------------------------------------


def test_show_a_finished_run_with_stages_tasks_and_a_timeline():
    run = tests.pipes.crawl.start(context={"items": 3}, key="example.com")
    drain()
    out, _ = pipeline("show", str(run.pk))
    head = dict(line.split(None, 1) for line in out.split("\ncontext:")[0].splitlines())
    assert head["run"] == f"#{run.pk}"
    assert (head["pipeline"], head["key"], head["status"]) == ("crawl-site", "example.com", "succeeded")
    assert head["progress"] == "7/7 tasks done" and "context" not in head
    assert '\ncontext:\n  {\n    "items": 3\n  }\n' in out  # JSON, as `jobs show` prints a payload
    assert "error" not in head and {"queued", "started", "finished", "duration"} <= set(head)
    stages = {columns(line)[0]: columns(line) for line in section(out, "STAGE")}
    assert list(stages) == ["discover", "fetch", "media", "index"]
    assert [(row[1], row[2]) for row in stages.values()] == [
        ("succeeded", "1/1"), ("succeeded", "3/3"), ("succeeded", "2/2"), ("succeeded", "1/1"),
    ]
    fetched = [columns(line) for line in section(out, "stage fetch: 3 task(s)")[1:]]
    assert [row[:4] for row in fetched] == [["p.fetch", str(i), "succeeded", "1"] for i in range(3)]
    timeline = section(out, "timeline: 60 columns")
    bars = {columns(line)[1]: BAR.search(line).group(1) for line in timeline}
    assert list(bars) == ["p.discover", "p.fetch[0]", "p.fetch[1]", "p.fetch[2]", "p.thumbs", "p.transcode", "p.index"]
    for name, drawn in bars.items():
        assert re.fullmatch(r" *#+ *", drawn), name  # one stretch of #, on the common axis
    # The index ran after what it needs, by the database clock, and so further right.
    assert bars["p.index"].index("#") >= bars["p.discover"].index("#")
    assert bars["p.index"].index("#") >= max(bars[f"p.fetch[{i}]"].index("#") for i in range(3))


def test_show_a_failed_run_names_the_error_of_the_run_its_stage_and_its_task():
    run = FAILING.start()
    drain()
    out, _ = pipeline("show", str(run.pk))
    error = "stage 'second' failed: task p.fail failed: RuntimeError: always fails"
    assert f"status    failed\nerror     {error}\n" in out
    stages = section(out, "STAGE")
    assert [columns(line)[:3] for line in stages] == [
        ["first", "succeeded", "1/1"], ["second", "failed", "1/1"], ["third", "cancelled", "0/0"],
    ]
    assert stages[1].endswith("task p.fail failed: RuntimeError: always fails")
    failed = section(out, "stage second: 1 task(s)")[1]
    assert columns(failed)[:3] == ["p.fail", "failed", "2"]  # attempts: the handler's two
    assert failed.endswith("RuntimeError: always fails")
    assert "stage third:" not in out  # a stage that never started has no tasks to list


def test_show_lists_at_most_50_tasks_of_a_stage_failed_first_and_counts_the_rest():
    run = FANOUT.start(context={"items": 120})
    drain(max_jobs=1)  # p.discover, whose end queues the 120 tasks at once
    each = StageRun.objects.get(run=run, name="each")
    doomed = list(TaskRun.objects.filter(stage=each, item_index__in=[100, 110]).values_list("job_id", flat=True))
    assert jobqueue.discard(doomed) == 2  # their tasks are recorded as failed at once
    out, _ = pipeline("show", str(run.pk))
    lines = section(out, "stage each: 120 task(s)")
    header, *tasks, more = lines
    assert columns(header) == ["TASK", "ITEM", "STATUS", "ATTEMPTS", "DURATION", "ERROR"]
    assert [columns(line)[1:3] for line in tasks] == (
        [[str(i), "queued"] for i in range(48)] + [["100", "failed"], ["110", "failed"]]
    )
    assert "its job #" in tasks[-1] and "was deleted" in tasks[-1]
    assert more == "  ... and 70 more: 70 queued"
    assert columns(section(out, "STAGE")[1])[:3] == ["each", "running", "2/120"]
    # Nothing of that stage has started: the timeline shows p.discover alone.
    assert "; 50 task(s) listed above have not started" in out
    assert [columns(line)[1] for line in section(out, "timeline:")] == ["p.discover"]


def test_show_calls_a_task_whose_job_runs_running_and_times_it_by_its_job():
    run = WATCHED.start()
    worker = JobWorker(queues=["default"], concurrency=1, burst=True, poll=0.01)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: Job.objects.filter(name="p.watch", status=Job.RUNNING).exists(), 20, "p.watch to run")
        out, _ = pipeline("show", str(run.pk))
        task = columns(section(out, "stage w: 1 task(s)")[1])
        assert task[:3] == ["p.watch", "running", "0"] and re.fullmatch(r"\d+(ms|\.\ds)", task[3])
        line = section(out, "timeline:")[0]
        assert columns(line)[:2] == ["w", "p.watch"] and "#" in BAR.search(line).group(1)
        assert columns(section(out, "STAGE")[0])[:3] == ["w", "running", "0/1"]
        assert pipeline("cancel", str(run.pk)) == (f"run #{run.pk} cancelled\n", "")
    finally:
        run.cancel()
        thread.join(30)
    assert not thread.is_alive()
    out, _ = pipeline("show", str(run.pk))
    assert "status    cancelled" in out
    # The handler saw the cancel and returned; its outcome is recorded late.
    assert columns(section(out, "stage w: 1 task(s)")[1])[:2] == ["p.watch", "succeeded"]


def test_show_counts_left_out_tasks_whose_job_runs_as_running():
    run = WATCHERS.start(context={"items": 60})
    drain(max_jobs=1)  # p.discover, whose end queues 60 p.watch tasks at once
    each = StageRun.objects.get(run=run, name="each")
    doomed = list(TaskRun.objects.filter(stage=each, item_index__lt=50).values_list("job_id", flat=True))
    assert jobqueue.discard(doomed) == 50  # their tasks are recorded as failed at once
    worker = JobWorker(queues=["default"], concurrency=1, burst=True, poll=0.01)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(
            lambda: TaskRun.objects.filter(stage=each, status=TaskRun.FAILED).count() == 50
            and Job.objects.filter(name="p.watch", status=Job.RUNNING).exists(),
            20, "50 failed tasks and one p.watch running",
        )
        out, _ = pipeline("show", str(run.pk))
    finally:
        run.cancel()
        thread.join(30)
    assert not thread.is_alive()
    _, *tasks, more = section(out, "stage each: 60 task(s)")
    assert [columns(line)[1:3] for line in tasks] == [[str(i), "failed"] for i in range(50)]
    assert more == "  ... and 10 more: 1 running, 9 queued"


def test_timeline_bars_and_durations():
    origin = datetime(2030, 1, 1, tzinfo=UTC)
    assert bar(origin, origin, origin, 60.0) == "#" + " " * 59  # an instant still shows
    assert bar(origin + timedelta(seconds=30), origin + timedelta(seconds=45), origin, 60.0) == (
        " " * 30 + "#" * 15 + " " * 15
    )
    assert bar(origin + timedelta(seconds=59.5), origin + timedelta(seconds=90), origin, 60.0) == " " * 59 + "#"
    assert bar(None, None, origin, 60.0) == " " * 60
    assert [span(s) for s in (0.0412, 12.34, 187, 7500, 277200)] == ["41ms", "12.3s", "3m07s", "2h05m", "3d05h"]


# -- steering ---------------------------------------------------------------------------


def test_pause_resume_and_cancel_say_what_happened():
    run = tests.pipes.three.start()
    pk = run.pk

    def status() -> str:
        return Run.objects.get(pk=pk).status

    assert pipeline("pause", str(pk))[0] == f"run #{pk} paused\n" and status() == Run.PAUSED
    assert pipeline("pause", str(pk))[0] == f"run #{pk} was already paused\n" and status() == Run.PAUSED
    assert pipeline("resume", str(pk))[0] == f"run #{pk} resumed\n" and status() == Run.RUNNING
    assert pipeline("resume", str(pk))[0] == f"run #{pk} was not paused; its queued tasks were checked\n"
    assert pipeline("cancel", str(pk))[0] == f"run #{pk} cancelled\n" and status() == Run.CANCELLED
    assert pipeline("cancel", str(pk))[0] == f"run #{pk} had already ended\n"
    before = everything()
    assert fails(2, "pause", str(pk)) == f"cannot pause pipeline run #{pk}: it has cancelled"
    assert fails(2, "resume", str(pk)) == f"cannot resume pipeline run #{pk}: it has cancelled"
    assert everything() == before


def test_restart_runs_a_failed_stage_again_and_refuses_what_does_not_apply():
    run = FAILING.start()
    drain()
    out, _ = pipeline("restart", str(run.pk), "second")
    assert out == f"run #{run.pk}: stage second restarted; the run is running\n"
    stages = {stage.name: stage for stage in StageRun.objects.filter(run=run)}
    assert (stages["second"].status, stages["second"].restarts) == (StageRun.RUNNING, 1)
    assert (stages["first"].status, stages["third"].status) == (StageRun.SUCCEEDED, StageRun.WAITING)
    before = everything()
    assert "is running: only a failed or cancelled stage can be restarted" in fails(2, "restart", str(run.pk), "second")
    assert "is succeeded: only a failed or cancelled stage" in fails(2, "restart", str(run.pk), "first")
    assert f"run #{run.pk} has no stage 'nope' (stages: first, second, third)" in fails(
        2, "restart", str(run.pk), "nope"
    )
    assert everything() == before
    drain()
    assert fails(1, "wait", str(run.pk)).endswith(
        f"run #{run.pk} failed: stage 'second' failed: task p.fail failed: RuntimeError: always fails"
    )


# -- wait -------------------------------------------------------------------------------


def test_wait_exits_0_1_or_75():
    done = tests.pipes.crawl.start()
    drain()
    assert pipeline("wait", str(done.pk)) == (f"run #{done.pk} succeeded\n", "")
    live = tests.pipes.three.start()
    began = time.monotonic()
    assert fails(75, "wait", str(live.pk), "--timeout", "0.3") == f"run #{live.pk} is still running after 0.3s"
    assert 0.3 <= time.monotonic() - began < 5
    live.cancel()
    assert fails(1, "wait", str(live.pk)) == f"run #{live.pk} cancelled"
    assert "not a duration: 'soon'" in fails(2, "wait", str(live.pk), "--timeout", "soon")
    assert "duration must be > 0" in fails(2, "wait", str(live.pk), "--timeout", "0")


def test_wait_returns_once_a_run_ends_meanwhile():
    run = tests.pipes.crawl.start()
    worker = threading.Thread(target=drain)
    began = time.monotonic()
    worker.start()
    try:
        assert pipeline("wait", str(run.pk), "--timeout", "60")[0] == f"run #{run.pk} succeeded\n"
    finally:
        worker.join(60)
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("action", ["show", "cancel", "pause", "resume", "wait", "restart"])
@pytest.mark.parametrize(
    "text, message",
    [
        ("seven", "a run id is a whole number from 1 to 9223372036854775807, not 'seven'"),
        ("1.5", "a run id is a whole number from 1 to 9223372036854775807, not '1.5'"),
        ("0", "a run id is a whole number from 1 to 9223372036854775807, not '0'"),
        ("-3", "a run id is a whole number from 1 to 9223372036854775807, not '-3'"),
        ("987654", "no pipeline run #987654"),
        ("9" * 30, f"a run id is a whole number from 1 to 9223372036854775807, not '{'9' * 30}'"),
    ],
)
def test_a_run_that_is_not_there_exits_2_with_one_line(action, text, message):
    before = everything()
    assert fails(2, action, text, *(["stage"] if action == "restart" else [])) == message
    assert everything() == before


# -- the command line -------------------------------------------------------------------


def test_the_command_line_exit_codes(manage, child_env):
    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [*manage, "pipeline", *args]
        return subprocess.run(argv, check=False, env=child_env, capture_output=True, text=True, timeout=60)

    started = cli("start", "crawl-site", "--import", "tests.pipes", "--context", '{"items": 2}')
    assert started.returncode == 0 and "Error" not in started.stderr  # an INFO line says it started
    assert re.fullmatch(r"\d+\n", started.stdout)
    run = started.stdout.strip()
    assert Run.objects.get(pk=run).context == {"items": 2}
    late = cli("wait", run, "--timeout", "0.5")
    assert late.returncode == 75
    assert late.stderr.splitlines() == [f"CommandError: run #{run} is still running after 0.5s"]
    drain()
    assert cli("wait", run).returncode == 0
    failed = FAILING.start()
    drain()
    ended = cli("wait", str(failed.pk))
    assert ended.returncode == 1
    assert ended.stderr.splitlines() == [
        f"CommandError: run #{failed.pk} failed: stage 'second' failed: task p.fail failed: RuntimeError: always fails"
    ]
    bad = cli("show", "seven")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.splitlines() == ["CommandError: a run id is a whole number from 1 to 9223372036854775807, not 'seven'"]


# -- prune ------------------------------------------------------------------------------


def test_prune_deletes_runs_that_ended_long_ago_and_never_a_live_one():
    old = tests.pipes.crawl.start(context={"items": 3})
    drain()
    failed = FAILING.start()
    drain()
    recent = tests.pipes.crawl.start()
    drain()
    live = tests.pipes.three.start()
    jobs = Job.objects.count()
    long_ago = Run.objects.get(pk=old.pk).finished_at - timedelta(days=40)
    Run.objects.filter(pk__in=[old.pk, failed.pk]).update(finished_at=long_ago)
    Run.objects.filter(pk=live.pk).update(queued_at=long_ago)  # old, but live
    assert pipeline("prune", "--older-than", "30d") == ("deleted 2 pipeline run(s) that ended more than 30d ago\n", "")
    assert sorted(Run.objects.values_list("pk", flat=True)) == [recent.pk, live.pk]
    assert set(StageRun.objects.values_list("run_id", flat=True)) == {recent.pk, live.pk}
    assert set(TaskRun.objects.values_list("run_id", flat=True)) == {recent.pk, live.pk}
    assert Job.objects.count() == jobs  # the queue's rows are leases_prune's
    assert pipeline("prune", "--older-than", "30d")[0].startswith("deleted 0 ")
    before = everything()
    assert "--older-than: not a duration: 'soon'" in fails(2, "prune", "--older-than", "soon")
    # A bare number is refused, as leases_prune and `jobs discard` refuse it: not 7 seconds, nor 7 days.
    assert "--older-than: '7' needs a unit: 7s, 7m, 7h" in fails(2, "prune", "--older-than", "7")
    assert "--timeout: not a duration: 'soon'" in fails(2, "wait", str(live.pk), "--timeout", "soon")
    assert everything() == before


def test_prune_leaves_a_run_restarted_meanwhile(monkeypatch):
    run = FAILING.start()
    drain()
    Run.objects.filter(pk=run.pk).update(finished_at=Run.objects.get(pk=run.pk).finished_at - timedelta(days=2))
    locked = store.locked

    def restarted_first(run_id, using):
        """The run is restarted between prune's listing and its lock."""
        if Run.objects.get(pk=run_id).status != Run.RUNNING:
            Run.objects.filter(pk=run_id).update(status=Run.RUNNING, finished_at=None)
        return locked(run_id, using)

    monkeypatch.setattr(store, "locked", restarted_first)
    assert prune(86400) == 0
    assert Run.objects.filter(pk=run.pk).exists() and TaskRun.objects.filter(run=run).exists()
