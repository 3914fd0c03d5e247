"""The jobs list in a real browser: at 1,400 px wide, beside the admin's two sidebars, the
whole table is on screen (no horizontal scrollbar), with long task names, workers' whole
host names and every status in its rows.

Headless Chromium opens the page through two test-only views of this module's URLconf:
one hands it the test client's session (its command line takes no cookies), the other
serves the admin's page with a script added that measures the table once the page's
own scripts ran (the nav sidebar opens then). --dump-dom prints the measurement.
"""
from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.urls import path, resolve

from leases.clock import db_now
from leases.tasks.models import Job, Queue

from ..browser import needs_chromium, session_urls, snapshot

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

JOBS = "/admin/leases_tasks/job/"
MEASURE = """<script>
window.addEventListener("load", () => {
  const table = document.getElementById("result_list");
  const box = document.querySelector("#changelist-form .results");
  const out = document.createElement("pre");
  out.id = "leases-measure";
  out.textContent = JSON.stringify({
    box: box.clientWidth, table: table.scrollWidth, page: document.documentElement.scrollWidth,
    window: window.innerWidth, sidebar: document.getElementById("main").classList.contains("shifted"),
    columns: [...table.querySelectorAll("thead th")].map(th => th.className),
  });
  document.body.appendChild(out);
});
</script>"""


def measured(request: HttpRequest, page: str) -> HttpResponse:
    """Test only: the admin's page at /`page`, with the measuring script."""
    match = resolve(f"/{page}")
    response = match.func(request, *match.args, **match.kwargs)
    response.render()
    return HttpResponse(response.content.decode().replace("</body>", f"{MEASURE}</body>"))


urlpatterns = session_urls(f"/measured{JOBS}", path("measured/<path:page>", measured))


def seed() -> None:
    """A page of jobs as a busy site has them: Django tasks' long module paths, workers
    named by their whole host name, every status, a queue with a long name."""
    now = db_now()
    names = ["crawl.fetch_page", "myproject.emails.tasks.send_welcome_email", "reports.build_monthly_invoice_pdf",
             "noop"]
    statuses = [Job.READY, Job.RUNNING, Job.SUCCEEDED, Job.FAILED, Job.DEAD, Job.CANCELLED, Job.BLOCKED]
    for queue in ("default", "crawl-priority"):
        Queue.objects.create(name=queue)
    for n in range(35):
        status = statuses[n % len(statuses)]
        ran = status not in Job.WAITING
        Job.objects.create(
            queue=("default", "crawl-priority")[n % 2], name=names[n % len(names)], key=f"key-{n}-{'x' * 30}",
            status=status, attempt=int(ran), max_attempts=1000 if n % 5 == 0 else 3,
            run_at=now - timedelta(minutes=n), enqueued_at=now - timedelta(hours=2),
            started_at=now - timedelta(minutes=90 + n) if ran else None,
            finished_at=now - timedelta(minutes=n) if status in Job.FINISHED else None,
            expires_at=now + timedelta(seconds=-40 if n % 3 else 30) if status == Job.RUNNING else None,
            worker=f"crawl-worker-{n % 9}.eu-west.prod.example.com:{31000 + n}:9f3a1c2b" if ran else "",
        )


@pytest.mark.urls(__name__)
def test_the_jobs_list_fits_a_1400_px_screen(client, live_server, tmp_path):
    needs_chromium()
    seed()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    shot = tmp_path / "jobs.png"
    dom = snapshot(tmp_path / "profile", "--window-size=1400,1000", f"--screenshot={shot}", "--dump-dom",
                   f"{live_server.url}/browser-session/{session}/")

    assert 'id="login-form"' not in dom
    found = re.search(r'<pre id="leases-measure">(.*?)</pre>', dom)
    assert found, "the page did not measure itself"
    size = json.loads(found.group(1).replace("&quot;", '"'))
    assert size["window"] == 1400 and size["sidebar"]  # the admin's nav sidebar open: the narrow case
    assert size["table"] <= size["box"], f"the table is {size['table']}px in a box of {size['box']}px"
    assert size["page"] <= size["window"]
    shown = {part for classes in size["columns"] for part in classes.split() if part.startswith("column-")}
    assert shown >= {"column-id", "column-job_name", "column-queue", "column-status_text", "column-attempts",
                     "column-when", "column-worker_short"}
    assert dom.count('class="field-id"') == Job.objects.count()
