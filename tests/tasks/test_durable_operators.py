"""What operators see and do of durable jobs from the shell: `jobs send-event` (sent, the
waiting job woken, one line of confirmation; every bad input one line, exit 2, nothing
written), `jobs show` (what a suspended job waits for and until when, a cancel asked of a
running one, its steps and the events no wait took yet), `jobs list` and `jobs stats`
(sleeping and waiting jobs, after a retry too) and `jobs cancel` of a running or ended job.

The rows are made by the engine: durable handlers below run in an in-process worker and
suspend on their sleep or wait, as they would in production."""
from __future__ import annotations

import re
import subprocess
from datetime import timedelta

import pytest

from leases.clock import db_now
from leases.tasks import handler, push
from leases.tasks.jobs.steps import EVENT_NAME_LENGTH, SHOWN
from leases.tasks.models import Job, JobEvent, JobStep
from leases.tasks.worker import JobWorker
from tests.helpers import jobs_command as run
from tests.helpers import jobs_command_fails as fails

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

#: The queues of the handlers below, and a second one some jobs are pushed to.
QUEUE, OTHER = "durops", "durops-b"
CLOCK = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"


def fetched(payload: dict) -> dict:
    """A step's result: what the handler was given, and a credential it read on the way."""
    return {"page": payload.get("page", 1), "token": "tok-1", "long": payload.get("long", "")}


def fail_first(payload: dict, ctx) -> None:
    if payload.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")


@handler("ops.nap", queue=QUEUE, max_attempts=3, backoff=0.0)
def nap(payload, ctx):
    """Fetch, then sleep (durably) for payload["sleep"] seconds."""
    ctx.step("fetch", fetched, payload)
    fail_first(payload, ctx)
    ctx.sleep(payload["sleep"])
    return {"slept": True}


def approve(payload, ctx):
    """Fetch, then wait for the event "approved" (payload["timeout"] seconds, or forever)."""
    ctx.step("fetch", fetched, payload)
    fail_first(payload, ctx)
    return {"approved": ctx.wait_for("approved", timeout=payload.get("timeout"))}


@handler("ops.pages", queue=QUEUE, max_attempts=1)
def pages(payload, ctx):
    """Many steps, then a wait: a job whose steps outnumber what operators are shown."""
    for page in range(payload["pages"]):
        ctx.step("page", lambda n: n, page)
    return ctx.wait_for("approved")


handler("ops.approve", queue=QUEUE, max_attempts=3, backoff=0.0)(approve)
handler("ops.approve.b", queue=OTHER, max_attempts=3, backoff=0.0)(approve)


def work() -> None:
    JobWorker(queues=[QUEUE, OTHER], burst=True, poll=0.01).run()


def suspended(name: str, payload: dict, **options) -> Job:
    """A job pushed and run until its handler suspends it: ready, waiting in the database."""
    job = push(name, payload, **options)
    work()
    job.refresh_from_db()
    assert job.status == Job.READY and job.waiting_for, (job.status, job.waiting_for)
    return job


def ended(payload: dict | None = None, **options) -> Job:
    """A job of ops.approve that got its event and succeeded."""
    job = suspended("ops.approve", payload or {}, **options)
    run("send-event", str(job.pk), "approved")
    work()
    job.refresh_from_db()
    assert job.status == Job.SUCCEEDED
    return job


def rows(out: str) -> dict[str, list[str]]:
    """A table's lines by their first cell, split on runs of two or more spaces."""
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in out.splitlines()[1:])}


def fields(out: str) -> dict[str, str]:
    """The head of `jobs show`: {field: value}."""
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.split("\npayload:")[0].splitlines())


def section(out: str, heading: str) -> list[list[str]]:
    """The rows of the table under a heading of `jobs show` ("steps (2):"), its head left
    out; the table ends where the next block's first line is."""
    lines = out.split(heading + "\n", 1)[1].splitlines()
    width = len(re.split(r"\s{2,}", lines[0]))
    found = []
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line)
        if len(cells) != width:
            break
        found.append(cells)
    return found


def steps(out: str) -> dict[str, list[str]]:
    """The steps table of `jobs show`, by place."""
    heading = re.search(r"^steps \(\d+\):$", out, re.M).group(0)
    return {cells[0]: cells for cells in section(out, heading)}


def written() -> list:
    """Everything send-event could write: the events, and the jobs' run times and waits."""
    return [list(JobEvent.objects.order_by("pk").values()),
            list(Job.objects.order_by("pk").values("pk", "status", "run_at", "waiting_for"))]


# -- send-event --------------------------------------------------------------------------


def test_send_event_by_id_wakes_the_waiting_job_and_says_so_in_one_line():
    job = suspended("ops.approve", {})
    assert job.run_at > db_now()  # no timeout: it waits, holding no worker, until the event
    out = run("send-event", str(job.pk), "approved", "--data", '{"by": "ana", "ok": true}')
    assert out == f"sent the event 'approved' to job #{job.pk}\n"
    job.refresh_from_db()
    assert job.run_at <= db_now()  # woken: due now
    (event,) = JobEvent.objects.filter(job_id=job.pk)
    assert (event.name, event.data, event.taken_seq) == ("approved", {"by": "ana", "ok": True}, None)
    work()
    job.refresh_from_db()
    assert job.status == Job.SUCCEEDED and job.result == {"approved": {"by": "ana", "ok": True}}
    assert JobEvent.objects.get(pk=event.pk).taken_seq == 2  # taken by the wait, step 2
    assert list(JobStep.objects.filter(job_id=job.pk).values_list("seq", "name", "done")) == [
        (1, "fetch", True), (2, "wait:approved", True)]


def test_send_event_by_key_reaches_the_unfinished_job_of_that_key():
    earlier = ended({"order": 7}, key="order-7")  # the key's job that ended is passed over
    job = suspended("ops.approve", {"order": 7, "again": True}, key="order-7")
    out = run("send-event", "approved", "--key", "order-7")
    assert out == f"sent the event 'approved' to job #{job.pk}\n"
    work()
    assert Job.objects.get(pk=job.pk).result == {"approved": None}  # no --data: null
    assert JobEvent.objects.filter(job_id=earlier.pk).count() == 1  # its own, sent before it ended


def test_an_event_for_a_sleeping_job_is_kept_and_does_not_wake_it():
    job = suspended("ops.nap", {"sleep": 3600})
    run("send-event", str(job.pk), "approved", "--data", "[1, 2]")
    assert Job.objects.get(pk=job.pk).run_at == job.run_at  # it sleeps on: no wait of that name
    assert JobEvent.objects.get(job_id=job.pk).taken_seq is None


@pytest.mark.parametrize("args, message", [
    (("send-event", "99999", "approved"), "no job #99999: the event 'approved' was not sent"),
    (("send-event", "approved", "--key", "nobody"),
     "no unfinished job pushed with key 'nobody': the event was not sent"),
    (("send-event", "ENDED", "approved"),
     "job #ENDED has ended (succeeded): the event 'approved' was not sent"),
    (("send-event", "approved", "--key", "done-1"),
     "no unfinished job pushed with key 'done-1': the event was not sent"),
    (("send-event", "WAITING", "approved", "--data", "{bad"),
     "--data is not valid JSON: Expecting property name"),
    (("send-event", "WAITING", "approved", "--data", ""), "--data is not valid JSON: Expecting value"),
    (("send-event", "WAITING", "approved", "--data", "[" * 100_000 + "]" * 100_000),
     "--data is nested too deeply"),
    (("send-event", "WAITING", "approved", "--data", "NaN"), "the event's data"),
    (("send-event", "WAITING", ""), "event name must be a non-empty string"),
    (("send-event", "WAITING", "  "), "event name must be a non-empty string"),
    (("send-event", "WAITING", "x" * (EVENT_NAME_LENGTH + 1)),
     f"event name is longer than {EVENT_NAME_LENGTH} characters"),
    (("send-event", "WAITING", "ap\u200bproved"), "must not contain control or invisible characters"),
    (("send-event", "approved"), "send-event: give the job's id (jobs send-event JOB EVENT) or --key KEY"),
    (("send-event", "WAITING"), "send-event: the event's name is missing (jobs send-event WAITING EVENT)"),
    (("send-event", "WAITING", "approved", "--key", "order-1"), "send-event: give the job's id or --key, not both"),
    (("send-event", "abc", "approved"), "a job id is a whole number from 1 to"),
])
def test_send_event_bad_input_is_one_line_exit_2_and_writes_nothing(args, message):
    waiting = suspended("ops.approve", {"n": 1}, key="order-1")
    done = ended({"n": 2}, key="done-1")
    args = [arg.replace("ENDED", str(done.pk)).replace("WAITING", str(waiting.pk)) for arg in args]
    message = message.replace("ENDED", str(done.pk)).replace("WAITING", str(waiting.pk))
    before = written()
    assert message in fails(*args)
    assert written() == before


def test_the_command_line_exits_2_with_one_line_and_sends_nothing(manage, child_env):
    """A real `manage.py jobs send-event`, system checks and all."""
    job = suspended("ops.approve", {})

    def cli(*args: str) -> subprocess.CompletedProcess:
        argv = [*manage, "jobs", "send-event", *args]
        return subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=60, check=False)

    bad = cli(str(job.pk), "approved", "--data", "{'by': 'ana'}")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "CommandError: --data is not valid JSON: Expecting property name enclosed in double quotes: line 1"
        " column 2 (char 1)"
    ]
    missing = cli("99999", "approved")
    assert (missing.returncode, missing.stderr) == (
        2, "CommandError: no job #99999: the event 'approved' was not sent\n")
    assert not JobEvent.objects.exists()
    sent = cli(str(job.pk), "approved", "--data", '{"by": "ana"}')
    assert (sent.returncode, sent.stderr) == (0, "")
    assert sent.stdout == f"sent the event 'approved' to job #{job.pk}\n"
    assert JobEvent.objects.get().data == {"by": "ana"}


# -- show ---------------------------------------------------------------------------------


def test_show_says_what_a_sleeping_job_waits_for_and_lists_its_steps():
    job = suspended("ops.nap", {"sleep": 3600, "page": 4})
    out = run("show", str(job.pk))
    head = fields(out)
    assert head["status"] == "sleeping" and head["attempts"] == "0/3" and head["worker"] == "-"
    assert re.fullmatch(rf"its sleep's end, {CLOCK} \(in 59m\)", head["waits for"])
    assert head["waits for"].split(", ", 1)[1] == head["run at"]  # the job runs again then
    found = steps(out)
    assert list(found) == ["1", "2"]
    assert found["1"][1:3] == ["fetch", "done"] and re.fullmatch(CLOCK, found["1"][3])
    assert found["1"][4] == '{"long": "", "page": 4, "token": "tok-1"}'
    assert found["2"][1:3] == ["sleep", "until in 59m"] and found["2"][4] == "-"
    assert "cancel asked" not in out and "events not yet taken" not in out
    JobStep.objects.filter(job=job, seq=2).update(until=db_now() - timedelta(minutes=5))
    Job.objects.filter(pk=job.pk).update(run_at=db_now() - timedelta(minutes=5))
    work()  # the sleep is over: the job runs on and succeeds
    assert steps(run("show", str(job.pk)))["2"][1:3] == ["sleep", "ended 5m ago"]


def test_show_lists_the_last_steps_of_a_job_of_many():
    job = suspended("ops.pages", {"pages": SHOWN + 20})
    out = run("show", str(job.pk))
    found = {cells[0]: cells for cells in section(out, f"steps (the last {SHOWN} of {SHOWN + 21}):")}
    assert list(found) == [str(seq) for seq in range(22, SHOWN + 22)]  # the newest, in order
    assert found[str(SHOWN + 21)][1] == "wait:approved" and found["22"][1:3] == ["page", "done"]


def test_show_says_which_event_a_job_waits_for_and_until_when():
    timed = suspended("ops.approve", {"timeout": 600})
    forever = suspended("ops.approve", {})
    out = run("show", str(timed.pk))
    assert re.fullmatch(rf"the event 'approved', or its timeout {CLOCK} \(in 9m\)", fields(out)["waits for"])
    assert steps(out)["2"][1:3] == ["wait:approved", "until in 9m"]
    head = fields(run("show", str(forever.pk)))
    assert head["status"] == "waiting for 'approved'"
    assert head["waits for"] == "the event 'approved' (no timeout)"


def test_show_lists_the_events_no_wait_took_yet_and_no_more_once_taken():
    job = suspended("ops.nap", {"sleep": 3600})
    run("send-event", str(job.pk), "approved", "--data", '{"by": "ana"}')
    run("send-event", str(job.pk), "approved", "--data", "2")
    run("send-event", str(job.pk), "resized", "--data", '"x\u202e"')  # a raw right-to-left override
    events = section(run("show", str(job.pk)), "events not yet taken (3):")
    assert [(name, data) for name, _, data in events] == [
        ("approved", '{"by": "ana"}'), ("approved", "2"), ("resized", '"x\\u202e"')]  # the override escaped
    assert all(re.fullmatch(CLOCK, sent) for _, sent, _ in events)
    waiting = suspended("ops.approve", {"timeout": 600})
    run("send-event", str(waiting.pk), "approved", "--data", "1")
    work()  # the wait takes it, and the job succeeds
    out = run("show", str(waiting.pk))
    assert "events not yet taken" not in out and "waits for" not in out
    assert steps(out)["2"][1:3] == ["wait:approved", "done"] and steps(out)["2"][4] == '{"data": 1}'


def test_show_prints_a_step_result_as_it_prints_the_payload_cut_to_one_line():
    """Who runs the command may act on jobs (as one who may change them in the admin): a
    step's result is shown as stored, a credential too, as the payload is; one line of it,
    cut to a cell's width."""
    job = suspended("ops.nap", {"sleep": 3600, "long": "y" * 150, "token": "tok-9"})
    out = run("show", str(job.pk))
    assert '"token": "tok-9"' in out.split("\nresult:")[0]  # the payload, as stored
    result = steps(out)["1"][4]
    assert result.startswith('{"long": "' + "y" * 80) and result.endswith("...") and len(result) == 100
    assert '"token": "tok-1"' in run("show", str(suspended("ops.nap", {"sleep": 600}).pk))


# -- list, stats ----------------------------------------------------------------------------


def test_list_and_stats_name_sleeping_and_waiting_jobs_after_a_retry_too():
    sleeping = suspended("ops.nap", {"sleep": 3600})
    waiting = suspended("ops.approve", {"timeout": 600})
    retried = suspended("ops.approve.b", {"fail_first": True})  # failed once, then waits
    retried_nap = suspended("ops.nap", {"sleep": 3600, "fail_first": True}, queue=OTHER)
    plain = push("ops.nap", {"sleep": 60}, delay=600)  # not run yet: ready, not suspended
    listed = rows(run("list"))
    assert [listed[str(job.pk)][3:5] for job in (sleeping, waiting, retried, retried_nap, plain)] == [
        ["sleeping", "0/3"], ["waiting for 'approved'", "0/3"], ["waiting for 'approved'", "1/3"],
        ["sleeping", "1/3"], ["ready", "0/3"],
    ]
    assert listed[str(retried.pk)][5] == "in 3649d"  # no timeout: its run time is a long way off
    stats = run("stats").splitlines()
    assert [line for line in stats if line.startswith("queue ")] == [
        f"queue {QUEUE}: 1 durable job(s) sleeping, 1 waiting for an event",
        f"queue {OTHER}: 1 durable job(s) sleeping, 1 waiting for an event",
    ]
    assert rows("\n".join(stats))[QUEUE][1:5] == ["3", "0", "0", "0"]  # all three ready, none due
    assert [line for line in run("stats", "--queue", OTHER).splitlines() if line.startswith("queue ")] == [
        f"queue {OTHER}: 1 durable job(s) sleeping, 1 waiting for an event"]


def test_a_job_woken_by_its_event_no_longer_reads_as_waiting():
    waiting = suspended("ops.approve", {"timeout": 600})
    sleeping = suspended("ops.nap", {"sleep": 3600})
    run("send-event", str(waiting.pk), "approved")
    assert rows(run("list"))[str(waiting.pk)][3] == "ready"  # due now, for the next worker
    out = run("show", str(waiting.pk))
    assert fields(out)["status"] == "ready" and "waits for" not in out
    assert section(out, "events not yet taken (1):")[0][0] == "approved"
    stats = run("stats")
    assert f"queue {QUEUE}: 1 durable job(s) sleeping, 0 waiting for an event" in stats
    assert rows(stats)[QUEUE][4] == "1"  # due
    assert fields(run("show", str(sleeping.pk)))["status"] == "sleeping"


def test_stats_says_nothing_of_durable_jobs_when_none_is_suspended():
    push("ops.nap", {"sleep": 60}, delay=600)
    ended()
    assert "durable" not in run("stats")


# -- cancel ---------------------------------------------------------------------------------


@pytest.fixture
def claimed():
    """A durable job that stepped and waits, then claimed again by a worker: running."""
    job = suspended("ops.approve", {"timeout": 600})
    run("send-event", str(job.pk), "approved")
    worker = JobWorker(queues=[QUEUE], ttl=30)
    worker.register()
    (running,) = worker.claim(1)
    assert running.id == job.pk
    yield Job.objects.get(pk=job.pk)
    worker.hand_back()


def test_cancel_of_a_running_job_asks_it_to_stop_and_show_says_so(claimed):
    assert claimed.status == Job.RUNNING and claimed.cancel_requested_at is None
    assert "cancel asked" not in run("show", str(claimed.pk))
    assert run("cancel", str(claimed.pk)) == "cancelled 1 of 1 (1 running: asked to stop)\n"
    job = Job.objects.get(pk=claimed.pk)
    assert job.status == Job.RUNNING and job.cancel_requested_at is not None  # its worker ends it
    head = fields(run("show", str(job.pk)))
    assert re.fullmatch(rf"{CLOCK} \(\d+s ago\)", head["cancel asked"]) and head["status"] == "running"
    assert "waits for" not in head
    # Asked again: not "ended already", and the first time it was asked stays.
    assert run("cancel", str(job.pk)) == "cancelled 1 of 1 (1 running: asked to stop)\n"
    assert Job.objects.get(pk=job.pk).cancel_requested_at == job.cancel_requested_at


def test_cancel_of_a_suspended_job_cancels_it_and_of_an_ended_one_exits_1():
    job = suspended("ops.nap", {"sleep": 3600})
    assert run("cancel", str(job.pk)) == "cancelled 1 of 1\n"
    job.refresh_from_db()
    assert job.status == Job.CANCELLED and job.cancel_requested_at is None
    done = ended()
    for pk, status in ((done.pk, "succeeded"), (job.pk, "cancelled")):
        assert fails("cancel", str(pk), code=1) == f"cancelled 0 of 1: 1 ended already (#{pk} is {status})"
    assert Job.objects.get(pk=done.pk).cancel_requested_at is None
