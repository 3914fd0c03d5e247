"""The live dashboard: htmx (django-htmx's, served by the dashboard itself) asks for the
page's fragments every few seconds and swaps each panel in by its id; Pause and Resume;
the links from a queue, a pool or a pipeline to its rows in the admin; and a headless
Chromium, driven over the DevTools protocol (tests/leases/browser.py), that sees new
counts appear without a reload.
"""
from __future__ import annotations

import html
import re
import time
from datetime import timedelta
from importlib import metadata, resources

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.urls import reverse

import leases.ops.dashboard
import leases.ops.htmx
from leases.clock import db_now
from leases.pipelines.models import Run
from leases.pool import Pool
from leases.tasks.models import Job, Queue

from ..browser import Browser, needs_chromium, session_urls
from .test_dashboard import CHARTS, seed, waiting_job

pytestmark = pytest.mark.django_db(transaction=True)

URL = reverse("leases:dashboard")
#: The first chart's label: jobs finished per minute over the last hour.
FINISHED = "document.querySelector('svg.leases-chart').getAttribute('aria-label')"


urlpatterns = session_urls(URL)


@pytest.fixture
def root(client) -> User:
    user = User.objects.create_superuser("root", password="pw")
    client.force_login(user)
    return user


def controls(page: str) -> str:
    return re.search(r'<p id="leases-controls".*?</p>', page, re.S).group(0)


def test_an_htmx_request_gets_each_panel_as_a_fragment(client, root):
    seed(db_now())
    response = client.get(URL, HTTP_HX_REQUEST="true")
    assert response.status_code == 200 and "HX-Request" in response["Vary"]
    fragment = response.content.decode()
    assert "<html" not in fragment and "<h1>" not in fragment
    sections = re.findall(r'<section id="leases-panel-([a-z0-9-]+)"[^>]*hx-swap-oob="true"', fragment)
    # Every panel, and a chart in each but "Jobs waiting for a resource" and "Durable jobs
    # suspended", with none waiting or suspended here.
    assert sections == [panel.key for panel in response.context["panels"]] and len(sections) == CHARTS + 2
    assert fragment.count('class="leases-chart"') == CHARTS
    live = controls(fragment)
    assert 'hx-swap-oob="true"' in live and 'hx-trigger="every 5s"' in live
    assert 'hx-get="/leases/dashboard/?live=1"' in live

    page = client.get(URL).content.decode()  # the same ids, so each fragment replaces its panel
    assert re.findall(r'<section id="leases-panel-([a-z0-9-]+)"', page) == sections
    assert 'hx-trigger="every 5s"' in controls(page) and "hx-swap-oob" not in page


def test_pause_and_resume_are_links_to_the_page(client, root):
    paused = client.get(URL, {"live": "0"}).content.decode()
    assert "hx-trigger" not in controls(paused) and "Paused." in controls(paused)
    assert 'id="leases-resume" href="/leases/dashboard/?live=1" hx-get="/leases/dashboard/?live=1"' in paused
    fragment = client.get(URL, {"live": "0"}, HTTP_HX_REQUEST="true").content.decode()
    assert "hx-trigger" not in controls(fragment) and 'hx-swap-oob="true"' in controls(fragment)
    live = client.get(URL).content.decode()
    assert 'id="leases-pause" href="/leases/dashboard/?live=0" hx-get="/leases/dashboard/?live=0"' in live
    response = client.get(URL, {"live": "yes"})
    assert response.status_code == 400 and response.content == b"live must be 0 or 1\n"


def test_the_page_loads_htmx_from_django_htmx_without_the_app_installed(client, root):
    assert "django_htmx" not in settings.INSTALLED_APPS
    page = client.get(URL).content.decode()
    head = page.split('id="content-start"')[0]
    src = f"{reverse('leases:htmx')}?v={metadata.version('django-htmx')}"
    assert f'<script src="{src}" defer>' in head
    client.logout()  # public code: no session needed
    response = client.get(src)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/javascript")
    assert "immutable" in response["Cache-Control"]
    assert response.content == (resources.files("django_htmx") / leases.ops.htmx.SCRIPT).read_bytes()


def test_queues_pools_and_pipelines_link_to_their_rows_in_the_admin(client, root):
    seed(db_now())
    page = client.get(URL).content.decode()
    jobs, runs, resources_ = (reverse(f"admin:{name}_changelist") for name in
                              ("leases_tasks_job", "leases_pipelines_run", "leases_resource"))
    links = {html.unescape(href) for href in re.findall(r'<a href="([^"]+)"', page)}
    wanted = {
        f"{jobs}?queue=crawl": {"queue": "crawl"},  # a queue's line under throughput, its failures row
        f"{jobs}?queue=crawl&status__exact={Job.FAILED}": {"queue": "crawl", "status": Job.FAILED},
        f"{jobs}?queue=crawl&status__exact={Job.READY}": {"queue": "crawl", "status": Job.READY},  # waiting
        f"{runs}?pipeline=nightly-crawl": {"pipeline": "nightly-crawl"},
        f"{runs}?pipeline=export&status__exact=paused": {"pipeline": "export", "status": "paused"},
        f"{resources_}?pool__exact=proxies": {"pool": "proxies"},
    }
    assert set(wanted) <= links
    for link, fields in wanted.items():
        response = client.get(link)
        assert response.status_code == 200, link  # the admin took every filter (no ?e=1)
        rows = list(response.context["cl"].result_list)
        assert rows and all(getattr(row, field) == v for row in rows for field, v in fields.items()), link
    held = client.get(f"{resources_}?pool__exact=proxies&state=held")
    assert len(held.context["cl"].result_list) == 24


@pytest.mark.django_db(transaction=True, databases=["default", "second"])
def test_another_databases_page_links_to_that_databases_admin_site(client, root, settings):
    settings.LEASES_ROUTES = {"pools": {"eu-*": "second"}}
    Pool("eu-proxies").add("p1")
    page = client.get(URL, {"database": "second"}).content.decode()
    link = reverse("leases_second:leases_resource_changelist") + "?pool__exact=eu-proxies"
    assert f'<a href="{link}">' in page
    assert 'hx-get="/leases/dashboard/?database=second&amp;live=1"' in controls(page)  # refreshes stay on it
    rows = client.get(link).context["cl"].result_list
    assert [row.name for row in rows] == ["p1"]


def finish(count: int) -> None:
    """Finish `count` waiting jobs now, as a worker would have, by the database clock."""
    now = db_now()
    ids = list(Job.objects.filter(status=Job.READY).values_list("id", flat=True)[:count])
    Job.objects.filter(id__in=ids).update(status=Job.SUCCEEDED, started_at=now - timedelta(seconds=1),
                                          finished_at=now, attempt=1)


@pytest.mark.urls(__name__)
def test_a_live_page_shows_new_counts_without_a_reload(client, root, live_server, tmp_path, monkeypatch):
    needs_chromium()
    monkeypatch.setattr(leases.ops.dashboard, "EVERY", 1)  # the server thread reads it per page
    Queue.objects.create(name="crawl")
    Job.objects.bulk_create([waiting_job("crawl", "crawl.fetch", db_now() - timedelta(seconds=30))
                             for _ in range(5)])
    Run.objects.create(pipeline="nightly", status=Run.RUNNING, definition={}, queued_at=db_now())
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    browser = Browser(tmp_path / "profile", "--window-size=1400,1150")
    try:
        browser.open(f"{live_server.url}/browser-session/{session}/")
        browser.wait_for("window.htmx && document.querySelector('#leases-controls[hx-trigger]')")
        browser.evaluate("window.sameDocument = true")  # a reload would forget it
        assert browser.evaluate(FINISHED).endswith(": 0 succeeded, 0 failed or dead")

        finish(3)
        browser.wait_for(f"{FINISHED}.endsWith(': 3 succeeded, 0 failed or dead')")
        assert browser.evaluate("window.sameDocument") is True

        browser.evaluate("document.querySelector('#leases-pause').click()")
        browser.wait_for("document.querySelector('#leases-resume')")
        finish(2)
        time.sleep(3)  # three refreshes, were it live
        assert browser.evaluate(FINISHED).endswith(": 3 succeeded, 0 failed or dead")
        assert browser.evaluate("!document.querySelector('#leases-controls[hx-trigger]')")

        browser.evaluate("document.querySelector('#leases-resume').click()")
        browser.wait_for(f"{FINISHED}.endsWith(': 5 succeeded, 0 failed or dead')")
        assert browser.evaluate("window.sameDocument") is True

        # drill down: the queue in the waiting chart's legend opens its ready jobs in the admin
        browser.evaluate("document.querySelector('.leases-legend a[href*=\"queue=crawl\"]').click()")
        browser.wait_for("location.pathname === '/admin/leases_tasks/job/'"
                         " && document.querySelector('#changelist')")
        assert browser.evaluate("location.search") == f"?queue=crawl&status__exact={Job.READY}"
    finally:
        browser.close()
