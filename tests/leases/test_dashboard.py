"""The dashboard: staff who may view the models it reads, charts drawn from a fixed
number of queries, bars on whole minutes and hours, queue depth rebuilt from job rows as
each bar's peak, failures as parts of each queue's jobs, internal jobs left out of the
finished counts, and a real headless Chromium that renders the page.

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
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import Group, Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import leases.ops.dashboard
from leases.clock import db_now
from leases.models import Resource
from leases.ops.charts import DAY, HOUR
from leases.pipelines import machine
from leases.pipelines.models import Run
from leases.tasks.dispatcher import Dispatcher
from leases.tasks.models import Job, Queue
from leases.tasks.readings import finished_per_bar, waiting_per_bar

from ..browser import needs_chromium, session_urls, snapshot

pytestmark = pytest.mark.django_db(transaction=True)

URL = reverse("leases:dashboard")
#: Charts of the page with every app installed: finished and waiting jobs over two
#: windows, failures per queue, pools, dispatchers, pipeline runs.
CHARTS = 8
#: The view permissions of the panels: jobs (six panels), pools, dispatchers, runs.
JOBS, POOLS, DISPATCHERS, RUNS = (
    "leases_tasks.view_job", "leases.view_resource", "leases_tasks.view_taskpool", "leases_pipelines.view_run"
)
HEADINGS = {
    JOBS: ["Jobs finished per minute, the last hour", "Jobs finished per hour, the last day",
           "Jobs waiting, the last hour", "Jobs waiting, the last day", "Failures per queue, the last day",
           "Jobs waiting for a resource", "Durable jobs suspended"],
    POOLS: ["Resource pools"],
    DISPATCHERS: ["Dispatchers"],
    RUNS: ["Pipeline runs: live, and ended in the last day"],
}


urlpatterns = session_urls(URL)


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


def permission(name: str) -> Permission:
    app_label, codename = name.split(".")
    return Permission.objects.get(content_type__app_label=app_label, codename=codename)


def staff_user(*permissions: str, name: str = "ops", **fields) -> User:
    user = User.objects.create_user(name, password="pw", is_staff=True, **fields)
    user.user_permissions.add(*(permission(p) for p in permissions))
    return user


def labels(html: str) -> list[str]:
    """The aria-labels of the charts (the admin's own icons are SVGs too)."""
    return re.findall(r'<svg [^>]*class="leases-chart"[^>]*aria-label="([^"]*)"', html)


def test_staff_see_the_charts_in_the_admin_frame(client):
    seed(db_now())
    client.force_login(staff_user(*HEADINGS))
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
    assert headings == [heading for group in HEADINGS.values() for heading in group]
    assert "24 held · 5 cooling · 3 quarantined · 8 free of 40" in html
    assert "425 in pool · 75 in buckets · 3 workers" in html
    assert reverse("leases:metrics") in html


def test_the_charts_say_what_the_rows_hold(client):
    seed(db_now())
    client.force_login(staff_user(*HEADINGS))
    response = client.get(URL)
    found, shown = labels(response.content.decode()), response.context["now"]
    hour = Job.objects.filter(finished_at__range=(HOUR.start(shown), shown))  # whole minutes, then this one
    ok = hour.filter(status=Job.SUCCEEDED).count()
    bad = hour.filter(status__in=(Job.FAILED, Job.DEAD)).count()
    assert found[0] == (
        f"Jobs finished per minute over the last hour: {ok:,} succeeded, {bad:,} failed or dead"
    )
    waiting = Job.objects.filter(status__in=Job.WAITING).count()
    assert found[2].endswith(f"; {waiting:,} now") and found[3].endswith(f"; {waiting:,} now")


def at(start: datetime, minutes: int, seconds: float) -> datetime:
    return start + timedelta(minutes=minutes, seconds=seconds)


def hours_into(window_start: datetime, moment: datetime) -> int:
    return (moment - window_start) // timedelta(hours=1)


def test_queue_depth_is_the_peak_within_each_bar():
    now = db_now()
    start = HOUR.start(now)

    def minute(bar: int, seconds: float) -> datetime:
        return at(start, bar, seconds)

    Job.objects.bulk_create([
        # waited from half-way through bar 10 to half-way through bar 30: in both, and between
        Job(queue="q", name="a", key="a", status=Job.SUCCEEDED, run_at=minute(10, 30), enqueued_at=minute(10, 30),
            started_at=minute(30, 30), finished_at=minute(30, 45)),
        # still waiting since bar 54, and one since yesterday
        waiting_job("q", "b", minute(54, 10)),
        waiting_job("q", "b", now - timedelta(hours=30)),
        # cancelled while waiting: it left when it ended
        Job(queue="r", name="c", key="c", status=Job.CANCELLED, run_at=minute(56, 20), enqueued_at=minute(56, 20),
            finished_at=minute(57, 40)),
        # started before the window: never waiting in it
        waiting_job("q", "d", now - timedelta(minutes=90), Job.RUNNING),
        # a backlog of 40 that cleared in 22 s, within one minute
        *[Job(queue="s", name="e", key=f"e{n}", status=Job.SUCCEEDED, run_at=minute(40, 5), enqueued_at=minute(40, 5),
              started_at=minute(40, 27), finished_at=minute(40, 29)) for n in range(40)],
    ])
    hour = waiting_per_bar(HOUR, now, "default")
    expected = [1] * 60
    for bar in [*range(10, 31), *range(54, 60)]:
        expected[bar] += 1
    assert hour["q"].peaks == expected and hour["q"].now == 2
    assert hour["r"].peaks == [0] * 56 + [1, 1] + [0, 0] and hour["r"].now == 0
    assert hour["s"].peaks == [0] * 40 + [40] + [0] * 19 and hour["s"].now == 0

    day, begins = waiting_per_bar(DAY, now, "default"), DAY.start(now)
    expected = [1] * 24
    waited = {*range(hours_into(begins, minute(10, 30)), hours_into(begins, minute(30, 30)) + 1),
              *range(hours_into(begins, minute(54, 10)), 24)}
    for bar in waited:
        expected[bar] += 1
    assert day["q"].peaks == expected and day["q"].now == 2
    assert day["s"].peaks[hours_into(begins, minute(40, 5))] == 40


def test_finished_jobs_fall_in_the_minute_their_bar_names():
    now = db_now()
    start = HOUR.start(now)

    def minute(bar: int, seconds: float) -> datetime:
        return at(start, bar, seconds)

    Job.objects.bulk_create([
        finished_job("q", "a", Job.SUCCEEDED, minute(58, 8), ran=1, waited=1),
        finished_job("q", "a", Job.SUCCEEDED, minute(58, 15), ran=1, waited=1),
        finished_job("q", "a", Job.FAILED, minute(57, 30), ran=1, waited=1),
        finished_job("q", "a", Job.CANCELLED, minute(57, 30), ran=1, waited=1),
        finished_job("q", "a", Job.DEAD, minute(0, 0.5), ran=1, waited=1),
        finished_job("q", "a", Job.SUCCEEDED, minute(-1, 59), ran=1, waited=1),  # before the window
        finished_job("q", machine.EVENT, Job.SUCCEEDED, minute(58, 10), ran=1, waited=1),  # internal
    ])
    found = finished_per_bar(HOUR, now, "default")
    assert found["q", Job.SUCCEEDED] == [0] * 58 + [2, 0]
    assert found["q", Job.FAILED] == [0] * 57 + [1, 0, 0]
    assert found["q", Job.DEAD] == [1] + [0] * 59
    assert ("q", Job.CANCELLED) not in found
    begins = DAY.start(now)
    day = finished_per_bar(DAY, now, "default")["q", Job.SUCCEEDED]
    assert sum(day) == 3 and day[hours_into(begins, minute(58, 8))] >= 2


def frozen_page(client, monkeypatch, shown: datetime) -> str:
    """The page a superuser sees when the database clock reads `shown`."""
    monkeypatch.setattr(leases.ops.dashboard, "db_now", lambda using=None: shown)
    client.force_login(User.objects.create_superuser("root", password="pw"))
    return client.get(URL).content.decode()


def chart(html: str, *words: str) -> str:
    """The SVG of the first chart whose aria-label holds all of `words`."""
    for svg in html.split("<svg ")[1:]:
        label = re.search(r'aria-label="([^"]*)"', svg.split(">")[0])
        if label and all(word in label.group(1) for word in words):
            return svg.split("</svg>")[0]
    raise AssertionError(f"no chart says {words}")


def clock(moment: datetime, layout: str = "%H:%M") -> str:
    return timezone.localtime(moment).strftime(layout)


def test_a_bar_counts_the_whole_minute_its_label_names(client, monkeypatch):
    """Jobs that finished at 11:30:08 to 11:30:15 are the bar "11:30 to 11:31", whatever
    the second of the page's clock; the bar now runs in says it is partial."""
    aligned = db_now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    Job.objects.bulk_create([finished_job("q", "a", Job.SUCCEEDED, at(aligned, -10, second), ran=1, waited=1)
                             for second in range(8, 16)])
    html = frozen_page(client, monkeypatch, shown=aligned + timedelta(seconds=20))
    finished = chart(html, "Jobs finished per minute")
    minute = at(aligned, -10, 0)
    assert f"<title>{clock(minute)} to {clock(minute + timedelta(minutes=1))}: 8 succeeded</title>" in finished
    assert finished.count("8 succeeded</title>") == 1
    last = f"{clock(aligned)} to {clock(aligned + timedelta(minutes=1))}, so far (to {clock(aligned, '%H:%M:20')})"
    assert f"<title>{last}: none</title>" in finished
    hourly = chart(html, "Jobs finished per hour")
    assert f"<title>{clock(minute, '%a %H:00')} to" in hourly


def test_a_backlog_cleared_within_a_bar_shows_at_its_peak(client, monkeypatch):
    """40 jobs queued at 11:10:25 and all started by 11:10:47 peak at 40 in "11:10 to
    11:11", though none waited at any bar's end."""
    aligned = db_now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    queued, started = at(aligned, -20, 25), at(aligned, -20, 47)
    Job.objects.bulk_create([
        Job(queue="burst", name="e", key=f"e{n}", status=Job.SUCCEEDED, run_at=queued, enqueued_at=queued,
            started_at=started, finished_at=started + timedelta(seconds=1)) for n in range(40)
    ])
    html = frozen_page(client, monkeypatch, shown=aligned + timedelta(seconds=20))
    waiting = chart(html, "waiting", "each minute")
    minute = at(aligned, -20, 0)
    assert f"<title>{clock(minute)} to {clock(minute + timedelta(minutes=1))}: 40 burst</title>" in waiting
    assert "40 burst" in chart(html, "waiting", "each hour")


def test_failures_are_parts_of_each_queues_finished_jobs(client):
    """4 failed or dead of 98 draw a sliver, 2 of 2 a full bar."""
    ended = db_now() - timedelta(minutes=10)
    jobs = [finished_job("q", "a", Job.SUCCEEDED, ended, ran=1, waited=1) for _ in range(94)]
    jobs += [finished_job("q", "a", Job.FAILED, ended, ran=1, waited=1) for _ in range(3)]
    jobs += [finished_job("q", "a", Job.DEAD, ended, ran=1, waited=1)]
    jobs += [finished_job("r", "a", Job.FAILED, ended, ran=1, waited=1) for _ in range(2)]
    Job.objects.bulk_create(jobs)
    client.force_login(staff_user(JOBS))
    failures = chart(client.get(URL).content.decode(), "Failed and dead jobs")

    def width(title: str) -> float:
        return float(re.search(rf'width="([\d.]+)"[^>]*><title>{title}</title>', failures).group(1))

    assert width("q: 3 failed") == pytest.approx(480 * 3 / 98, abs=0.1)
    assert width("q: 1 dead") == pytest.approx(480 * 1 / 98, abs=0.1)
    assert width("q: 94 succeeded") == pytest.approx(480 * 94 / 98, abs=0.1)
    assert width("r: 2 failed") == pytest.approx(480)
    assert "4 of 98 (4.1%)" in failures


def test_internal_jobs_are_left_out_of_the_finished_counts(client):
    """A pipeline's advance events are the engine's bookkeeping, not the operators' work."""
    ended = db_now() - timedelta(minutes=5)
    Job.objects.bulk_create([
        *[finished_job("q", "echo", Job.SUCCEEDED, ended, ran=1, waited=1) for _ in range(2)],
        *[finished_job("q", machine.EVENT, Job.SUCCEEDED, ended, ran=1, waited=1) for _ in range(5)],
        finished_job("q", machine.EVENT, Job.FAILED, ended, ran=1, waited=1),
    ])
    client.force_login(staff_user(JOBS))
    html = client.get(URL).content.decode()
    found = labels(html)
    assert found[0].endswith(": 2 succeeded, 0 failed or dead")
    assert found[1].endswith(": 2 succeeded, 0 failed or dead")
    assert "0 of 2 (0.0%)" in chart(html, "Failed and dead jobs")
    assert "Internal jobs (an app&#x27;s bookkeeping, such as a pipeline&#x27;s advance events) are left out." in html


def test_an_empty_database_draws_empty_charts(client):
    client.force_login(staff_user(*HEADINGS))
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


def test_staff_who_may_view_none_of_its_models_get_403(client):
    seed(db_now())
    client.force_login(staff_user())
    response = client.get(URL)
    assert response.status_code == 403
    assert "crawl" not in response.content.decode() and "proxies" not in response.content.decode()


def test_each_panel_needs_the_view_permission_of_the_model_it_reads(client):
    seed(db_now())
    for n, granted in enumerate(([JOBS], [POOLS], [DISPATCHERS], [RUNS], [POOLS, RUNS])):
        client.force_login(staff_user(*granted, name=f"ops{n}"))
        response = client.get(URL)
        assert [panel.heading for panel in response.context["panels"]] == [
            heading for name, group in HEADINGS.items() if name in granted for heading in group
        ], granted
        html = response.content.decode()
        assert ("proxies" in html) == (POOLS in granted)
        assert ("sitemaps" in html) == (DISPATCHERS in granted)
        assert ("nightly-crawl" in html) == (RUNS in granted)
        assert (">crawl: " in html) == (JOBS in granted)  # a queue's link under the throughput


def test_a_groups_permissions_count_too(client):
    seed(db_now())
    viewers = Group.objects.create(name="viewers")
    viewers.permissions.add(permission(DISPATCHERS))
    user = staff_user()
    user.groups.add(viewers)
    client.force_login(user)
    assert [panel.heading for panel in client.get(URL).context["panels"]] == HEADINGS[DISPATCHERS]


def test_dashboard_queries_do_not_grow_with_rows(client):
    client.force_login(staff_user(*HEADINGS))
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


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.urls(__name__)
def test_a_browser_renders_the_dashboard(client, live_server, tmp_path):
    needs_chromium()
    seed(db_now())
    client.force_login(staff_user(is_superuser=True))  # the admin's sidebar lists every app
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    shot = tmp_path / "dashboard.png"
    dom = snapshot(tmp_path / "profile", "--window-size=1400,1150", f"--screenshot={shot}", "--dump-dom",
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
