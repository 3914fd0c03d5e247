"""The pipelines admin: runs by the database clock, a run's stages, tasks and timeline,
steering through the engine (recorded in the admin's history), masking for viewers, and
pages whose query count does not grow with runs or tasks."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import leases.ops.masking
import tests.pipes  # registers crawl-site, three-by-five and the p.* handlers
from leases.pipelines import Pipeline, Stage
from leases.pipelines.models import Run, StageRun, TaskRun
from leases.tasks.worker import JobWorker
from tests.helpers import table

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

RUNS = reverse("admin:leases_pipelines_run_changelist")
FAILING = Pipeline("adm-failing", [Stage("first", ["p.a1"]), Stage("second", ["p.refuse"]), Stage("third", ["p.a2"])])
FANOUT = Pipeline("adm-fanout", [Stage("discover", ["p.discover"]), Stage("each", ["p.a3"], for_each="p.discover")])


def drain(max_jobs: int | None = None) -> None:
    JobWorker(queues=["default"], concurrency=1 if max_jobs else 4, burst=True, poll=0.01, max_jobs=max_jobs).run()


def page_url(run: Run) -> str:
    return reverse("admin:leases_pipelines_run_change", args=[run.pk])


def steer_url(run: Run) -> str:
    return reverse("admin:leases_pipelines_run_steer", args=[run.pk])


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def act(client, action: str, runs: list[Run]) -> list[str]:
    response = client.post(RUNS, {"action": action, "_selected_action": [r.pk for r in runs]}, follow=True)
    assert response.status_code == 200
    return messages_of(response)


def login(client, *permissions: str) -> None:
    user = User.objects.create_user("-".join(permissions), password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=permissions))
    client.force_login(user)


def history(run: Run) -> list[str]:
    return [entry.change_message for entry in LogEntry.objects.filter(object_id=str(run.pk)).order_by("id")]


def status(run: Run) -> str:
    return Run.objects.get(pk=run.pk).status


def svg_of(page: str) -> ET.Element:
    """The page's timeline, which must be well-formed SVG."""
    found = re.search(r'<svg class="leases-timeline" .*?</svg>', page, re.S)
    assert found, "no timeline on the page"
    return ET.fromstring(found.group(0))


SVG = "{http://www.w3.org/2000/svg}"


# -- the list ---------------------------------------------------------------------------


def test_run_list_shows_pipeline_key_status_progress_and_filters(admin_client):
    done = tests.pipes.crawl.start(context={"items": 2}, key="example.com")
    drain()
    live = tests.pipes.three.start()
    stopped = FAILING.start(key="k2")
    stopped.cancel()
    rows = table(admin_client.get(RUNS), "id")
    assert list(rows) == [str(stopped.pk), str(live.pk), str(done.pk)]  # newest first
    first = rows[str(done.pk)]
    assert (first["pipeline"], first["key_text"], first["status_badge"]) == ("crawl-site", "example.com", "● succeeded")
    assert first["progress"] == "6/6"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", first["started"])
    assert re.fullmatch(r"\d+ms|\d+\.\ds", first["duration"])
    assert (rows[str(live.pk)]["key_text"], rows[str(live.pk)]["progress"]) == ("-", "0/5")
    assert rows[str(stopped.pk)]["status_badge"] == "● cancelled"

    def ids(**query: str) -> list[str]:
        return list(table(admin_client.get(RUNS, query), "id"))

    assert ids(status__exact="running") == [str(live.pk)]
    assert ids(pipeline="crawl-site") == [str(done.pk)]
    assert ids(q="example") == [str(done.pk)]  # a key prefix
    assert ids(q="three") == [str(live.pk)]  # a pipeline prefix
    filters = admin_client.get(RUNS).content.decode()
    for name in ("crawl-site", "three-by-five", "adm-failing"):
        assert f"?pipeline={name}" in filters


def test_run_list_queries_do_not_grow_with_runs(admin_client):
    def page(expected: int) -> int:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(RUNS)
        assert len(table(response, "id")) == expected
        return len(queries)

    tests.pipes.three.start()
    few = page(1)
    for _ in range(12):
        tests.pipes.crawl.start()
    assert page(13) == few


def test_runs_cannot_be_added_edited_or_deleted(admin_client):
    run = tests.pipes.three.start()
    response = admin_client.get(page_url(run))
    assert response.status_code == 200
    assert not response.context["has_change_permission"] and not response.context["has_delete_permission"]
    assert admin_client.get(reverse("admin:leases_pipelines_run_add")).status_code == 403
    assert admin_client.post(reverse("admin:leases_pipelines_run_delete", args=[run.pk])).status_code == 403
    assert admin_client.get(reverse("admin:leases_pipelines_run_change", args=["nope"])).status_code == 302
    assert Run.objects.filter(pk=run.pk, status=Run.RUNNING).exists()


# -- a run's page ---------------------------------------------------------------------


def test_a_runs_page_shows_stages_tasks_job_links_and_a_timeline(admin_client):
    run = tests.pipes.crawl.start(context={"items": 3})
    drain()
    page = admin_client.get(page_url(run)).content.decode()
    for stage in ("discover", "fetch", "media", "index"):
        assert f"<strong>{stage}</strong>" in page
    assert page.count("●</span> succeeded") >= 4 + 7  # the run's stages and tasks
    for task in TaskRun.objects.filter(run=run):
        assert reverse("admin:leases_tasks_job_change", args=[task.job_id]) in page
    svg = svg_of(page)
    bars = {rect.find(f"{SVG}title").text.split(":")[0]: float(rect.get("x")) for rect in svg.iter(f"{SVG}rect")}
    assert sorted(bars) == sorted([
        "discover / p.discover", "fetch / p.fetch[0]", "fetch / p.fetch[1]", "fetch / p.fetch[2]",
        "media / p.thumbs", "media / p.transcode", "index / p.index",
    ])
    # Bars sit on one axis by the recorded times: what depends on a stage starts after it.
    assert bars["index / p.index"] >= max(x for name, x in bars.items() if name != "index / p.index")
    assert bars["discover / p.discover"] <= min(bars.values())
    assert "now" not in [t.text for t in svg.iter(f"{SVG}title")]  # the run has ended


def test_a_live_runs_timeline_marks_now_and_waiting_stages_have_no_bars(admin_client):
    run = tests.pipes.three.start()
    drain(max_jobs=4)  # tasks of stage a and their events (which go first), not all of them
    recorded = TaskRun.objects.filter(run=run, started_at__isnull=False).count()
    assert 1 <= recorded < 5
    page = admin_client.get(page_url(run)).content.decode()
    svg = svg_of(page)
    titles = [rect.find(f"{SVG}title").text for rect in svg.iter(f"{SVG}rect")]
    assert len(titles) == recorded and all(title.startswith("a / p.a") for title in titles)
    assert "now" in [t.text for t in svg.iter(f"{SVG}title")]
    fresh = tests.pipes.three.start()
    assert "No task has started yet." in admin_client.get(page_url(fresh)).content.decode()


def test_a_runs_page_costs_the_same_for_120_and_600_items(admin_client):
    small, big = FANOUT.start(context={"items": 120}), FANOUT.start(context={"items": 600})
    drain(max_jobs=2)  # each p.discover, whose end queues its items

    def cost(run: Run, items: int) -> int:
        assert TaskRun.objects.filter(run=run).count() == items + 1
        with CaptureQueriesContext(connection) as queries:
            page = admin_client.get(page_url(run)).content.decode()
        assert f"… and {items - 50:,} more: {items - 50:,} queued" in page
        return len(queries)

    admin_client.get(page_url(small))  # the first page of a session reads a few things once
    assert cost(big, 600) == cost(small, 120)


def test_a_failed_runs_page_names_the_error_and_offers_a_restart(admin_client):
    run = FAILING.start()
    drain()
    page = admin_client.get(page_url(run)).content.decode()
    assert "stage &#x27;second&#x27; failed: task p.refuse failed: Fail: refused" in page
    assert 'name="steer" value="restart:second"' in page
    assert 'value="pause"' not in page and 'value="cancel"' not in page


# -- steering -------------------------------------------------------------------------


def test_buttons_pause_resume_cancel_and_restart_through_the_engine_and_are_recorded(admin_client):
    run = tests.pipes.three.start()
    page = admin_client.get(page_url(run)).content.decode()
    assert f'formaction="{steer_url(run)}" name="steer" value="pause"' in page
    assert 'value="cancel"' in page and 'value="resume"' not in page

    def press(value: str) -> list[str]:
        response = admin_client.post(steer_url(run), {"steer": value}, follow=True)
        assert response.redirect_chain[-1][0] == page_url(run)
        return messages_of(response)

    assert press("pause") == [f"Run #{run.pk}: pause done; it is paused."] and status(run) == Run.PAUSED
    assert 'value="resume"' in admin_client.get(page_url(run)).content.decode()
    assert press("pause") == [f"Run #{run.pk}: nothing to pause, it is paused."]
    assert press("resume") == [f"Run #{run.pk}: resume done; it is running."] and status(run) == Run.RUNNING
    assert press("cancel") == [f"Run #{run.pk}: cancel done; it is cancelled."] and status(run) == Run.CANCELLED
    assert press("pause") == [f"Run #{run.pk}: cannot pause pipeline run #{run.pk}: it has cancelled"]
    assert press("bogus") == ["Nothing to do: unknown button."]
    assert press("restart:a") == [f"Run #{run.pk}: restart of stage a done; it is running."]
    assert status(run) == Run.RUNNING and StageRun.objects.get(run=run, name="a").restarts == 1
    assert press("restart:zz")[0].startswith(f"Run #{run.pk}: pipeline run #{run.pk} has no stage 'zz'")
    assert history(run) == [
        "Pause from the admin.", "Resume from the admin.", "Cancel from the admin.",
        "Restart of stage a from the admin.",
    ]
    assert admin_client.get(steer_url(run)).status_code == 405  # a button is a POST


def test_viewers_get_no_buttons_and_cannot_steer(client):
    run = tests.pipes.three.start()
    login(client, "view_run")
    page = client.get(page_url(run))
    assert page.status_code == 200 and 'name="steer"' not in page.content.decode()
    assert client.post(steer_url(run), {"steer": "cancel"}).status_code == 403
    response = client.post(RUNS, {"action": "cancel_selected", "_selected_action": [run.pk]})
    assert response.status_code in (200, 302)
    assert status(run) == Run.RUNNING and not history(run)


def test_actions_steer_the_selected_runs_and_say_how_many_applied(admin_client):
    live = [tests.pipes.three.start() for _ in range(3)]
    assert act(admin_client, "pause_selected", live[:2]) == ["Pause: 2 of 2 selected runs."]
    assert act(admin_client, "pause_selected", live) == [
        "Pause: 1 of 3 selected runs. 2 did not apply (see each run's status)."
    ]
    assert act(admin_client, "resume_selected", live[:1]) == ["Resume: 1 of 1 selected run."]
    assert act(admin_client, "cancel_selected", live[1:]) == ["Cancel: 2 of 2 selected runs."]
    assert [status(r) for r in live] == [Run.RUNNING, Run.CANCELLED, Run.CANCELLED]
    failed = FAILING.start()
    drain()
    assert status(failed) == Run.FAILED
    assert act(admin_client, "restart_selected", [failed, live[0]]) == [
        "Restart: 1 of 2 selected runs. 1 did not apply (see each run's status)."
    ]
    stages = {s.name: s for s in StageRun.objects.filter(run=failed)}
    assert stages["second"].restarts == 1 and status(failed) == Run.RUNNING
    assert history(failed) == ["Restart from the admin."]
    assert history(live[1]) == ["Pause from the admin.", "Cancel from the admin."]


# -- masking --------------------------------------------------------------------------


@pytest.fixture
def secret_run() -> Run:
    """A failed run whose context and task error hold credentials."""
    leaky = Pipeline("adm-leaky", [Stage("only", ["p.refuse"])])
    run = leaky.start(context={"token": "tok-1", "proxy": "http://u:pw-2@proxy:3128"})
    drain()
    TaskRun.objects.filter(run=run).update(error="refused by https://api/v1?api_key=key-3&page=2")
    return run


def test_viewers_see_context_and_errors_masked(client, secret_run):
    login(client, "view_run")
    page = client.get(page_url(secret_run)).content.decode()
    for secret in ("tok-1", "pw-2", "key-3"):
        assert secret not in page
    mask = leases.ops.masking.MASK
    assert f"&quot;token&quot;: &quot;{mask}&quot;" in page and f"http://u:{mask}@proxy:3128" in page
    assert f"api_key={mask}&amp;page=2" in page


def test_who_may_steer_sees_context_and_errors_as_stored(client, secret_run):
    login(client, "view_run", "change_run")
    page = client.get(page_url(secret_run)).content.decode()
    assert "&quot;token&quot;: &quot;tok-1&quot;" in page and "http://u:pw-2@proxy:3128" in page
    assert "api_key=key-3&amp;page=2" in page and leases.ops.masking.MASK not in page
