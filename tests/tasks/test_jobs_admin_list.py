"""The jobs list: a search that never answers 500 (ids, payload fields, anything typed),
internal jobs kept out of the operators' way, one time column, and the limited keys in words."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tests.jobs  # noqa: F401 - registers the handlers
from leases.clock import db_now
from leases.tasks.models import Job, LimitKey, Queue
from tests.helpers import table

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

JOBS = reverse("admin:leases_tasks_job_changelist")
ADVANCE = "leases.pipelines.advance"  # internal: a pipeline's bookkeeping
BIGGEST_ID = 2**63 - 1  # of a BIGINT primary key


def make(name: str, payload=None, status: int = Job.READY, **fields) -> Job:
    now = db_now()
    started = None if status == Job.READY else now - timedelta(seconds=90)
    return Job.objects.create(
        queue="default", name=name, key=f"{name}-{Job.objects.count()}", payload=payload or {}, status=status,
        run_at=now - timedelta(seconds=12), enqueued_at=now - timedelta(minutes=5), started_at=started,
        finished_at=now - timedelta(seconds=30) if status in Job.FINISHED else None,
        expires_at=now + timedelta(seconds=30) if status == Job.RUNNING else None, **fields,
    )


def ids(response) -> set[int]:
    return {int(key) for key in table(response, "id")}


def messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# -- search -------------------------------------------------------------------------------


@pytest.mark.parametrize("term", ["²", "١٢", "9" * 19, "9" * 5000, f"#{'9' * 30}", str(BIGGEST_ID + 1)])
def test_a_search_for_what_is_no_63_bit_id_searches_text_and_answers(admin_client, term):
    make("noop")
    response = admin_client.get(JOBS, {"q": term})
    assert response.status_code == 200 and ids(response) == set()


def test_the_largest_id_is_still_an_id(admin_client):
    job = make("noop")
    assert ids(admin_client.get(JOBS, {"q": str(BIGGEST_ID)})) == set()
    assert ids(admin_client.get(JOBS, {"q": f"#{job.pk}"})) == {job.pk}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40)
       | st.from_regex(r"payload\.[a-z.:=_-]{0,8}[:=][0-9a-z'\" ]{0,6}", fullmatch=True))
@example("²")  # str.isdigit() says yes, int() says no
@example("9" * 5000)  # more digits than int() reads
def test_no_search_answers_500(admin_client, term):
    assert admin_client.get(JOBS, {"q": term}).status_code == 200


@pytest.fixture
def payloads() -> dict[str, Job]:
    return {
        "site": make("crawl.fetch", {"url": "https://Example.com/a", "n": 5}),
        "other": make("crawl.fetch", {"url": "http://other.org", "n": 55}),
        "nested": make("noop", {"page": {"owner": {"name": "O'Brien"}}, "tags": ["x", "news"]}),
        "text_five": make("noop", {"n": "5", "exact": "kept", "flag": True}),
        "none": make("noop", {"n": None, "flag": False}),
    }


@pytest.mark.parametrize("term, found", [
    ("payload.url:example.com", {"site"}),  # contains, any case
    ("payload.url:EXAMPLE", {"site"}),
    ("payload.url=HTTP://other.org", {"other"}),  # equals, any case
    ("payload.url=other.org", set()),
    ("payload.n=5", {"site", "text_five"}),  # 5 and "5" alike, on every database
    ('payload.n="5"', {"site", "text_five"}),
    ("payload.n:5", {"site", "other", "text_five"}),
    ("payload.n=null", {"none"}),  # JSON null, not a missing field
    ("payload.flag=true", {"text_five"}),
    ("payload.flag=false", {"none"}),
    ("payload.url=%", set()),  # a LIKE wildcard is a character
    ("payload.url:_", set()),
    ("payload.page.owner.name:o'brien", {"nested"}),  # nested; the quote reaches the database as data
    ("payload.tags.1=news", {"nested"}),  # a list's item by its index
    ("payload.exact=kept", {"text_five"}),  # a key named like a lookup is a key
    ('payload.url:"example.com/a"', {"site"}),
    ("payload.url:example payload.n=5", {"site"}),  # every term
    ("crawl payload.n:5", {"site", "other"}),  # with a name prefix
    ("noop payload.url:example", set()),
    ("payload.url:x') OR 1=1 --", set()),
])
def test_a_payload_field_is_found_by_its_value(admin_client, payloads, term, found):
    response = admin_client.get(JOBS, {"q": term})
    assert ids(response) == {payloads[name].pk for name in found}
    assert messages(response) == []


@pytest.mark.parametrize("term", ["payload.", "payload.url", "payload.:x", "payload.url:", "payload.a..b=1"])
def test_a_payload_term_that_cannot_be_read_finds_nothing_and_says_why(admin_client, payloads, term):
    response = admin_client.get(JOBS, {"q": term})
    assert response.status_code == 200 and ids(response) == set()
    (said,) = messages(response)
    assert said.startswith(f"Search: {term!r}:")


def test_a_payload_search_reads_only_the_newest_jobs_and_keeps_the_count_capped(admin_client, payloads,
                                                                                   monkeypatch):
    import leases.tasks.admin.search

    monkeypatch.setattr(leases.tasks.admin.search, "PAYLOAD_SCAN", 2)
    newest = make("crawl.fetch", {"url": "https://example.com/b"})
    assert ids(admin_client.get(JOBS, {"q": "payload.url:example"})) == {newest.pk}  # "site" is older
    with CaptureQueriesContext(connection) as queries:
        admin_client.get(JOBS, {"q": "payload.url:example"})
    counts = [q["sql"].upper() for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT" in q for q in counts)


def test_the_search_box_says_how_to_search(admin_client):
    page = admin_client.get(JOBS).content.decode()
    assert "payload.url:example.com" in page and "payload.n=5" in page


# -- internal jobs ------------------------------------------------------------------------


@pytest.fixture
def kinds() -> dict[str, Job]:
    return {
        "mine": make("noop"),
        "advance": make(ADVANCE, {"run": 1}, max_attempts=1000),
        "done": make("echo", status=Job.SUCCEEDED, attempt=1),
        "advanced": make(ADVANCE, {"run": 2}, status=Job.SUCCEEDED, attempt=1, max_attempts=1000),
    }


def pks(kinds: dict[str, Job], *names: str) -> set[int]:
    return {kinds[name].pk for name in names}


def test_internal_jobs_are_hidden_unless_asked_for(admin_client, kinds):
    page = admin_client.get(JOBS)
    assert ids(page) == pks(kinds, "mine", "done")
    assert ids(admin_client.get(JOBS, {"kind": "internal"})) == pks(kinds, "advance", "advanced")
    assert ids(admin_client.get(JOBS, {"kind": "all"})) == set(pks(kinds, *kinds))
    html = page.content.decode()
    assert "operators&#x27; jobs" in html and "?kind=internal" in html and "?kind=all" in html
    assert f"?name={ADVANCE}" not in html  # nor offered by the name filter
    assert "?name=noop" in html
    assert f"name={ADVANCE}" in admin_client.get(JOBS, {"kind": "all"}).content.decode()


def test_an_internal_jobs_page_opens_and_its_id_finds_it(admin_client, kinds):
    job = kinds["advance"]
    response = admin_client.get(reverse("admin:leases_tasks_job_change", args=[job.pk]))
    assert response.status_code == 200 and ADVANCE in response.content.decode()
    assert ids(admin_client.get(JOBS, {"q": str(job.pk)})) == {job.pk}


def test_the_queue_list_links_its_counts_to_jobs_of_every_kind(admin_client, kinds):
    Queue.objects.create(name="default")
    page = admin_client.get(reverse("admin:leases_tasks_queue_changelist")).content.decode()
    link = f"?queue=default&amp;status__exact={Job.READY}&amp;kind=all"
    assert link in page
    assert ids(admin_client.get(JOBS, {"queue": "default", "status__exact": Job.READY, "kind": "all"})) == pks(
        kinds, "mine", "advance")


def test_the_list_queries_do_not_grow_with_rows_of_either_kind(admin_client, kinds):
    def cost(**query: str) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert admin_client.get(JOBS, query).status_code == 200
        return len(queries)

    few = cost(), cost(kind="internal"), cost(kind="all")
    for n in range(15):
        make(ADVANCE if n % 2 else "noop", {"run": n}, status=Job.RUNNING if n % 3 else Job.SUCCEEDED,
             attempt=1, worker=f"w{n}")
    assert (cost(), cost(kind="internal"), cost(kind="all")) == few


# -- the columns ------------------------------------------------------------------------


def test_one_time_column_says_what_matters_for_each_status(admin_client):
    due, running, done = make("noop"), make("sleepy", status=Job.RUNNING, attempt=1), make("echo", status=Job.DEAD)
    rows = table(admin_client.get(JOBS), "id")
    assert rows[str(due.pk)]["when"] in ("12s ago", "13s ago")
    assert rows[str(running.pk)]["when"] in ("for 1m30s", "for 1m31s")
    assert rows[str(done.pk)]["when"] in ("30s ago, took 1m00s", "31s ago, took 1m00s")
    assert rows[str(running.pk)]["when.title"].startswith("started ") and "lease until" in rows[str(running.pk)][
        "when.title"]
    assert set(rows[str(due.pk)]) >= {"id", "job_name", "queue", "status_text", "attempts", "when", "worker_short"}
    assert not {"started", "finished", "duration", "lease", "run_in"} & set(rows[str(due.pk)])
    page = admin_client.get(reverse("admin:leases_tasks_job_change", args=[done.pk])).content.decode().lower()
    for label in ("queued", "started", "finished", "duration", "run at", "lease", "worker"):  # on the job's page
        assert f"<label>{label}:</label>" in page


def test_a_long_name_wraps_at_its_dots_and_a_worker_shows_its_host_and_pid(admin_client):
    job = make("myproject.emails.tasks.send_welcome_email", status=Job.RUNNING, attempt=1,
               worker="crawl-7.prod.example.com:4242:9f3a1c")
    page = admin_client.get(JOBS).content.decode()
    assert "myproject.<wbr>emails.<wbr>tasks.<wbr>send_welcome_email" in page
    assert 'title="crawl-7.prod.example.com:4242:9f3a1c">crawl-7:4242</span>' in page
    assert table(admin_client.get(JOBS), "id")[str(job.pk)]["job_name"] == job.name


def test_limited_keys_say_at_its_limit_in_words_and_hide_the_decisions(admin_client):
    LimitKey.objects.create(name="busy", decisions=7)
    LimitKey.objects.create(name="calm", decisions=3)
    make("noop", status=Job.BLOCKED, limit_key="busy")
    response = admin_client.get(reverse("admin:leases_tasks_limitkey_changelist"))
    rows = table(response, "name")
    assert rows["busy"]["at_limit"] == "at its limit" and rows["calm"]["at_limit"] == ""
    assert "decisions" not in rows["busy"]
    html = response.content.decode()
    assert "icon-yes" not in html and "icon-no" not in html and "Decisions" not in html

