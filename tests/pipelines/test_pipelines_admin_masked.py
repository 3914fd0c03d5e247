"""Pipeline runs' contexts, errors and events, and their stages' and tasks' errors, items
and results: masked for viewers (or not shown), and so neither searched nor filtered by
them; a right and a wrong guess get the same answer. Who may steer runs filters as before."""
from __future__ import annotations

import pytest
from django.urls import reverse

import tests.pipes  # noqa: F401 - registers the p.* handlers
from leases.pipelines import Pipeline, Stage
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks.worker import JobWorker
from tests.helpers import listed, staff

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

RUNS = reverse("admin:leases_pipelines_run_changelist")
LEAKY = Pipeline("adm-masked", [Stage("only", ["p.refuse"])])


@pytest.fixture
def secret_run() -> Run:
    """A failed run whose context, error, events and stage's and task's errors hold
    credentials, beside a failed run whose hold none."""
    LEAKY.start(context={"n": 1}, key="plain")
    run = LEAKY.start(context={"token": "RUNTOK-1"}, key="leaky")
    JobWorker(queues=["default"], concurrency=2, burst=True, poll=0.01).run()
    Run.objects.filter(pk=run.pk).update(error="failed with api_key=RUNKEY-2", events={"approved": {"pw": "RUNEV-3"}})
    StageRun.objects.filter(run=run).update(error="stage: token STAGETOK-4")
    TaskRun.objects.filter(run=run).update(error="task: token TASKTOK-5", result={"session": "TASKSES-6"})
    return run


GUESSES = [
    ({"context__icontains": "RUNTOK-1"}, {"context__icontains": "WRONG-1"}),
    ({"context__token__startswith": "RUN"}, {"context__token__startswith": "XUN"}),
    ({"error__icontains": "RUNKEY-2"}, {"error__icontains": "WRONG-2"}),
    ({"events__icontains": "RUNEV-3"}, {"events__icontains": "WRONG-3"}),
    ({"events__has_key": "approved"}, {"events__has_key": "declined"}),
]


@pytest.mark.parametrize("right, wrong", [
    *GUESSES,
    ({"stages__error__icontains": "STAGETOK-4"}, {"stages__error__icontains": "WRONG-4"}),
    ({"tasks__error__icontains": "TASKTOK-5"}, {"tasks__error__icontains": "WRONG-5"}),
    ({"tasks__result__session": "TASKSES-6"}, {"tasks__result__session": "WRONG-6"}),
    ({"tasks__run__context__icontains": "RUNTOK-1"}, {"tasks__run__context__icontains": "WRONG-1"}),
])
def test_a_viewer_cannot_guess_a_runs_context_errors_or_events(client, secret_run, right, wrong):
    staff(client, "view_run")
    assert listed(client, RUNS, **right) == listed(client, RUNS, **wrong) == (400, None)
    assert listed(client, RUNS, q="RUNTOK-1") == listed(client, RUNS, q="WRONG-1") == (200, 0)


@pytest.mark.parametrize("right, wrong", GUESSES)
def test_who_may_steer_runs_filters_by_them_as_before(client, secret_run, right, wrong):
    staff(client, "view_run", "change_run")
    assert listed(client, RUNS, **right) == (200, 1)
    assert listed(client, RUNS, **wrong) == (200, 0)
