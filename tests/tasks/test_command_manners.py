"""What every command does the same way: a time left or ago reads alike in `lease`,
`schedule` and `jobs` (and the admin); argparse's refusals are one line, exit 2, like
every other bad input; a reader that goes away (`| head`) ends a command quietly."""
from __future__ import annotations

import io
import subprocess
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.jobs  # noqa: F401 - registers noop
import tests.pipes
from leases import Pool
from leases.clock import db_now
from leases.management.text import ago
from leases.models import Resource
from leases.pipelines.models import Run
from leases.tasks import push_many, schedule
from leases.tasks.models import Job, Schedule
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]


def out(*args: str) -> str:
    stdout = io.StringIO()
    call_command(*args, stdout=stdout, stderr=io.StringIO())
    return stdout.getvalue()


def test_every_command_says_a_time_left_or_ago_the_same_way():
    now = db_now()
    later, earlier = now + timedelta(hours=2, minutes=30), now - timedelta(hours=2, minutes=30)
    Pool("times").add("r")
    Pool("times").quarantine("r", seconds=9000)
    schedule("soon", "noop", at=later)
    job = Job.objects.create(queue="default", name="noop", key="k", run_at=later, enqueued_at=now)
    Job.objects.create(queue="default", name="noop", key="k2", run_at=earlier, enqueued_at=earlier)
    assert (ago(later, now), ago(earlier, now)) == ("in 2h", "2h ago")
    quarantined = out("lease", "list", "times")
    assert "  quarantined  " in quarantined and "Z (in 2h)" in quarantined  # as schedule list says it
    assert f"{later:%Y-%m-%d %H:%M:%S}Z (in 2h)" in out("schedule", "list")
    assert f"{later:%Y-%m-%d %H:%M:%S}Z (in 2h)" in out("schedule", "show", "soon")
    listed = out("jobs", "list")
    assert f"{job.pk}  " in listed and "  in 2h  " in listed and "  2h ago  " in listed
    assert f"{later:%Y-%m-%d %H:%M:%S}Z (in 2h)" in out("jobs", "show", str(job.pk))
    assert "  2h ago  " in out("jobs", "stats")  # the oldest due job


WORDS = ["--status", "--limit", "--queue", "--all", "--internal", "-x", "--", "list", "stats", "show",
         "retry", "--older-than", "--timeout"]
ARGS = st.lists(st.one_of(st.sampled_from(WORDS), st.text("abc-0123 ", max_size=6)), max_size=5)
COMMANDS = ["jobs", "pipeline", "schedule", "dispatch", "lease", "leases_prune"]


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(command=st.sampled_from(COMMANDS), args=ARGS)
def test_whatever_is_typed_is_done_or_refused_in_one_line_with_exit_2(command, args):
    if not Resource.objects.exists():
        Pool("pool").add("r")
        schedule("kept", "noop", every=60)
    before = [list(model.objects.order_by("pk").values()) for model in (Resource, Schedule, Job, Run)]
    try:
        out(command, *args)
    except CommandError as exc:
        assert exc.returncode == 2, exc
        assert "\n" not in str(exc)
    after = [list(model.objects.order_by("pk").values()) for model in (Resource, Schedule, Job, Run)]
    assert after == before


def test_argparse_refusals_on_the_command_line_are_one_line(manage, child_env):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*manage, *args], env=child_env, capture_output=True, text=True, timeout=60,
                              check=False)

    for args, error in [
        (("jobs",), "manage.py jobs: the following arguments are required: action"),
        (("jobs", "list", "--status"), "manage.py jobs list: argument --status: expected one argument"),
        (("leases_worker", "--log-format", "xml"), "manage.py leases_worker: argument --log-format: invalid"
                                                   " choice: 'xml' (choose from 'plain', 'json')"),
        (("lease", "list", "a", "b"), "manage.py lease: unrecognized arguments: b"),
    ]:
        done = cli(*args)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert done.stderr.splitlines() == [f"CommandError: {error} (see --help)"]


def closed_stdout(manage: list[str], env: dict, *args: str) -> tuple[int, str]:
    """Run a command whose reader has gone before it writes, as `| head` that read enough."""
    proc = subprocess.Popen([*manage, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(60), err


def test_a_reader_that_goes_away_ends_any_command_quietly(manage, child_env):
    push_many([("noop", {"n": n}) for n in range(300)])  # more than a pipe's buffer of lines
    Pool("pool").add("r")
    run = tests.pipes.crawl.start(context={"items": 3})
    JobWorker(queues=["default"], burst=True, poll=0.01, max_jobs=2).run()
    for args in (("jobs", "list", "--limit", "300"), ("lease", "list"), ("pipeline", "show", str(run.pk)),
                 ("schedule", "list")):
        code, err = closed_stdout(manage, child_env, *args)
        assert (code, err) == (141, ""), args  # 128 + SIGPIPE, as a shell reports `cat` killed by it
