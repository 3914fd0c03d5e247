"""The dashboard: staff only, charts drawn from a fixed number of queries, queue depth
rebuilt from job rows, and a real headless Chromium that renders the page.

The browser test logs the test client in, then hands that session to Chromium through
a test-only view of this module's URLconf (Chromium's command line takes no cookies):
the view sets the session cookie and redirects to the dashboard. Chromium dumps the DOM
it built and takes a screenshot in the same run. LEASES_DASHBOARD_SCREENSHOT=path keeps
the screenshot (docs/dashboard.png is made that way).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import struct
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpRequest, HttpResponseRedirect
from django.test.utils import CaptureQueriesContext
from django.urls import include, path, reverse

from leases.clock import db_now
from leases.models import Resource
from leases.ops.charts import DAY, HOUR
from leases.pipelines.models import Run
from leases.tasks.dispatcher import Dispatcher
from leases.tasks.models import Job, Queue
from leases.tasks.readings import finished_per_bar, waiting_per_bar

pytestmark = pytest.mark.django_db(transaction=True)

URL = reverse("leases:dashboard")
CHROMIUM = Path("/usr/bin/chromium")
#: Charts of the page with every app installed: finished and waiting jobs over two
#: windows, failures per queue, pools, dispatchers, pipeline runs.
CHARTS = 8


def hand_over(request: HttpRequest, key: str) -> HttpResponseRedirect:
    """Test only: give the browser the session the test client logged in with."""
    response = HttpResponseRedirect(URL)
    response.set_cookie(settings.SESSION_COOKIE_NAME, key, httponly=True)
    return response


urlpatterns = [path("browser-session/<str:key>/", hand_over), path("", include("project.urls"))]


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def finished_job(queue: str, name: str, status: int, ended: datetime, ran: float, waited: float) -> Job:
    started = ended - timedelta(seconds=ran)
    enqueued = started - timedelta(seconds=waited)
    return Job(queue=queue, name=name, key=f"{name}-{random.random()}", status=status, run_at=enqueued,
               enqueued_at=enqueued, started_at=started, finished_at=ended, attempt=1)


def waiting_job(queue: str, name: str, enqueued: datetime, status: int = Job.READY) -> Job:
    return Job(queue=queue, name=name, key=f"{name}-{random.random()}", status=status, run_at=enqueued,
               enqueued_at=enqueued, started_at=enqueued if status == Job.RUNNING else None)


def seed(now: datetime, suffix: str = "") -> None:
    """A day of a small crawler fleet: jobs finishing all day, a failure burst and a
    backlog in the last hour, three pools, two dispatchers, two pipelines. Each `suffix`
    adds as much again under other names."""
    rng = random.Random(f"seed{suffix}")
    queues = [f"{name}{suffix}" for name in ("crawl", "crawl", "crawl", "default", "mail")]
    for name in set(queues):
        Queue.objects.get_or_create(name=name)
    jobs = []
    for ago in range(24 * 60):
        for _ in range(rng.randint(2, 9) if ago < 60 else rng.randint(0, 3)):
            queue = rng.choice(queues)
            failing = 0.35 if 18 <= ago <= 26 and queue.startswith("crawl") else 0.04
            roll = rng.random()
            status = Job.SUCCEEDED if roll > failing else Job.FAILED if roll > failing / 4 else Job.DEAD
            waited = rng.uniform(60, 600) if 30 <= ago <= 50 else rng.uniform(0.1, 5)
            ended = now - timedelta(minutes=ago, seconds=rng.uniform(0, 60))
            jobs.append(finished_job(queue, "crawl.fetch", status, ended, rng.uniform(0.2, 20), waited))
    for _ in range(40):
        jobs.append(waiting_job(queues[0], "crawl.fetch", now - timedelta(minutes=rng.uniform(0, 14))))
    for n in range(8):
        jobs.append(waiting_job(queues[3], "report", now - timedelta(minutes=rng.uniform(0, 50)),
                                Job.BLOCKED if n % 2 else Job.READY))
    for _ in range(6):
        jobs.append(waiting_job(queues[0], "crawl.fetch", now - timedelta(seconds=rng.uniform(1, 30)),
                                Job.RUNNING))
    Job.objects.bulk_create(jobs, batch_size=500)

    later, soon = now + timedelta(minutes=5), now + timedelta(seconds=40)
    for pool, size, held, cooling, quarantined in (("proxies", 40, 24, 5, 3), ("accounts", 12, 10, 0, 1),
                                                   ("captcha-keys", 6, 2, 1, 0)):
        rows = []
        for n in range(size):
            quarantine = n >= size - quarantined
            rows.append(Resource(
                pool=f"{pool}{suffix}", name=f"{pool}-{n:03}", token=rng.randint(10, 400),
                holder=f"crawler-{n}" if n < held else "",
                busy_before=later if n < held or quarantine else soon if n < held + cooling else now,
                quarantined_until=now + timedelta(days=1) if quarantine else None,
            ))
        Resource.objects.bulk_create(rows)
    for name, size, workers in (("sitemaps", 500, 3), ("recrawl", 120, 1)):
        dispatcher = Dispatcher(f"{name}{suffix}")
        dispatcher.recreate_task_pool({f"https://example.com/{name}/{n}": float(n) for n in range(size)})
        for worker in range(workers):
            dispatcher.assign_tasks(25, f"worker-{worker}")
    for pipeline, statuses in (("nightly-crawl", ["running"] + ["succeeded"] * 6 + ["failed"]),
                               ("export", ["paused", "succeeded", "succeeded", "succeeded", "cancelled"])):
        for n, status in enumerate(statuses):
            Run.objects.create(
                pipeline=f"{pipeline}{suffix}", status=status, definition={},
                queued_at=now - timedelta(hours=n + 1),
                finished_at=None if status in Run.LIVE else now - timedelta(hours=n, minutes=30),
            )


def staff_user(**fields) -> User:
    return User.objects.create_user("ops", password="pw", is_staff=True, **fields)


def labels(html: str) -> list[str]:
    """The aria-labels of the charts (the admin's own icons are SVGs too)."""
    return re.findall(r'<svg [^>]*class="leases-chart"[^>]*aria-label="([^"]*)"', html)


def test_staff_see_the_charts_in_the_admin_frame(client):
    seed(db_now())
    client.force_login(staff_user())
    response = client.get(URL)
    assert response.status_code == 200
    html = response.content.decode()
    assert "<title>Leases dashboard | Django site admin</title>" in html
    assert 'class="breadcrumbs"' in html and reverse("admin:index") in html
    assert html.count('class="leases-chart"') == CHARTS and html.count('role="img"') == CHARTS
    assert len(labels(html)) == CHARTS and all(labels(html))
    assert html.count("<title>") == 1 + CHARTS + html.count("<g><title>") + html.count("</rect>")
    assert "<script" not in html.split('id="content-start"')[1]  # the charts need no script
    headings = [panel.heading for panel in response.context["panels"]]
    assert headings == [
        "Jobs finished per minute, the last hour", "Jobs finished per hour, the last day",
        "Jobs waiting, the last hour", "Jobs waiting, the last day", "Failures per queue, the last day",
        "Resource pools", "Dispatchers", "Pipeline runs: live, and ended in the last day",
    ]
    assert "24 held · 5 cooling · 3 quarantined · 8 free of 40" in html
    assert "425 in pool · 75 in buckets · 3 workers" in html
    assert reverse("leases:metrics") in html


def test_the_charts_say_what_the_rows_hold(client):
    now = db_now()
    seed(now)
    client.force_login(staff_user())
    found = labels(client.get(URL).content.decode())
    hour = Job.objects.filter(finished_at__range=(now - timedelta(hours=1), now))
    ok = hour.filter(status=Job.SUCCEEDED).count()
    bad = hour.filter(status__in=(Job.FAILED, Job.DEAD)).count()
    assert found[0] == (
        f"Jobs finished per minute over the last hour: {ok:,} succeeded, {bad:,} failed or dead"
    )
    waiting = Job.objects.filter(status__in=Job.WAITING).count()
    assert found[2].endswith(f"; {waiting:,} now") and found[3].endswith(f"; {waiting:,} now")


def test_queue_depth_is_rebuilt_from_enqueue_and_start_times():
    now = db_now()

    def ago(minutes: float) -> datetime:
        return now - timedelta(minutes=minutes)

    Job.objects.bulk_create([
        # waited from 30.5 to 10.5 minutes ago: at the ends of minutes -30 to -11 (20 bars)
        finished_job("q", "a", Job.SUCCEEDED, ago(10), ran=30, waited=20 * 60),
        # still waiting since 5.5 minutes ago, and one since yesterday
        waiting_job("q", "b", ago(5.5)),
        waiting_job("q", "b", ago(60 * 30)),
        # cancelled while waiting: it left when it ended
        Job(queue="r", name="c", key="c", status=Job.CANCELLED, run_at=ago(3.5), enqueued_at=ago(3.5),
            finished_at=ago(1.5)),
        # started before the window: never waiting in it
        waiting_job("q", "d", ago(90), Job.RUNNING),
    ])
    depth = waiting_per_bar(HOUR, now, "default")
    expected = [1] * 60
    for bar in range(29, 49):
        expected[bar] += 1
    for bar in range(54, 60):
        expected[bar] += 1
    assert depth["q"] == expected
    assert depth["r"] == [0] * 56 + [1, 1] + [0, 0]
    assert waiting_per_bar(DAY, now, "default")["q"] == [1] * 23 + [2]


def test_finished_jobs_fall_in_their_minute():
    now = db_now()
    Job.objects.bulk_create([
        finished_job("q", "a", Job.SUCCEEDED, now - timedelta(seconds=30), ran=1, waited=1),
        finished_job("q", "a", Job.FAILED, now - timedelta(seconds=90), ran=1, waited=1),
        finished_job("q", "a", Job.CANCELLED, now - timedelta(seconds=90), ran=1, waited=1),
        finished_job("q", "a", Job.DEAD, now - timedelta(minutes=59, seconds=30), ran=1, waited=1),
        finished_job("q", "a", Job.SUCCEEDED, now - timedelta(minutes=61), ran=1, waited=1),
    ])
    found = finished_per_bar(HOUR, now, "default")
    assert found["q", Job.SUCCEEDED] == [0] * 59 + [1]
    assert found["q", Job.FAILED] == [0] * 58 + [1, 0]
    assert found["q", Job.DEAD] == [1] + [0] * 59
    assert ("q", Job.CANCELLED) not in found
    assert finished_per_bar(DAY, now, "default")["q", Job.SUCCEEDED] == [0] * 22 + [1, 1]


def test_an_empty_database_draws_empty_charts(client):
    client.force_login(staff_user())
    html = client.get(URL).content.decode()
    assert len(labels(html)) == 4  # the time charts, all zero
    for text in ("No job finished in the last day.", "No resources yet.", "No dispatcher yet."):
        assert text in html


def test_others_are_sent_to_the_admin_login(client):
    login = reverse("admin:login")
    response = client.get(URL)
    assert response.status_code == 302 and response["Location"] == f"{login}?next={URL}"
    client.force_login(User.objects.create_user("user", password="pw"))
    assert client.get(URL)["Location"] == f"{login}?next={URL}"
    client.force_login(staff_user(is_active=False))
    assert client.get(URL).status_code == 302


def test_dashboard_queries_do_not_grow_with_rows(client):
    client.force_login(staff_user())
    client.get(URL)

    def cost() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get(URL).status_code == 200
        return len(queries)

    now = db_now()
    seed(now)
    jobs, few = Job.objects.count(), cost()
    seed(now, "-b")
    seed(now, "-c")
    assert Job.objects.count() > 2 * jobs
    assert cost() == few


def chromium(profile: Path, *args: str) -> str:
    """Run headless Chromium once; its stdout (the DOM with --dump-dom)."""
    argv = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        "--hide-scrollbars", f"--user-data-dir={profile}", *args,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.urls(__name__)
def test_a_browser_renders_the_dashboard(client, live_server, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is missing (Debian: apt-get install chromium); .ci/run installs it")
    seed(db_now())
    client.force_login(staff_user(is_superuser=True))  # the admin's sidebar lists every app
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    shot = tmp_path / "dashboard.png"
    dom = chromium(tmp_path / "profile", "--window-size=1400,1150", f"--screenshot={shot}", "--dump-dom",
                   f"{live_server.url}/browser-session/{session}/")

    assert 'id="login-form"' not in dom  # the session was taken: no login page
    assert "<h1>Leases dashboard</h1>" in dom
    assert dom.count('class="leases-chart"') == CHARTS
    assert len(labels(dom)) == CHARTS
    assert "Jobs finished per minute over the last hour:" in labels(dom)[0]
    assert dom.count("<rect ") > 200  # columns and bars drawn
    assert png_size(shot.read_bytes()) == (1400, 1150)
    assert shot.stat().st_size > 50_000  # charts, not a blank page
    if os.environ.get("LEASES_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["LEASES_DASHBOARD_SCREENSHOT"])
