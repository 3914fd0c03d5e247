"""Per-key limits in one process: who the claim takes and what it holds back (blocked or
delayed, no attempt used), unblocking as jobs end, operators' rules, and bad input.
JobWorker processes, SIGKILL and the head-of-line case: test_limit_processes."""
from __future__ import annotations

from datetime import timedelta

import pytest

import tests.jobs  # noqa: F401 - registers "limited", "rated" and "noop"
from leases.clock import db_now
from leases.tasks import handler, push, push_many
from leases.tasks.jobs import limits as limits_module
from leases.tasks.jobs.limits import check_rate, parse_rate
from leases.tasks.jobs.outcomes import Outcome
from leases.tasks.models import Job, LimitRule
from leases.tasks.worker import JobWorker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

READY, RUNNING, BLOCKED = Job.READY, Job.RUNNING, Job.BLOCKED


@pytest.fixture(autouse=True)
def fresh_rules():
    limits_module.forget_rules()
    yield
    limits_module.forget_rules()


def worker() -> JobWorker:
    w = JobWorker(queues=["default"], concurrency=50, poll=0.01)
    w.register()
    return w


def states(key: str) -> dict[int, int]:
    return dict(Job.objects.filter(limit_key=key).values_list("pk", "status"))


def finish(w: JobWorker, jobs) -> None:
    w.finish([Outcome(job, ok=True) for job in jobs])


def test_the_claim_takes_a_keys_concurrency_and_blocks_the_rest_without_using_attempts():
    a = [push("limited", {"key": "a", "n": n}).pk for n in range(5)]
    b = [push("limited", {"key": "b", "n": n}).pk for n in range(2)]
    plain = push("noop", {"n": 99}).pk
    w = worker()
    claimed = w.claim(10)
    assert sorted(job.id for job in claimed) == sorted(a[:2] + b + [plain])
    assert states("a") == {**dict.fromkeys(a[:2], RUNNING), **dict.fromkeys(a[2:], BLOCKED)}
    assert set(Job.objects.filter(pk__in=a[2:]).values_list("attempt", flat=True)) == {0}
    # A job of the key ends: one blocked job is ready again, and the next claim takes it.
    finish(w, [job for job in claimed if job.id == a[0]])
    assert states("a")[a[2]] == READY and list(states("a").values()).count(BLOCKED) == 2
    assert [job.id for job in w.claim(10)] == [a[2]]
    assert w.claim(10) == []  # two of "a" run: the rest stay blocked


def test_jobs_pushed_while_a_key_is_at_its_limit_are_blocked_at_their_first_claim():
    w = worker()
    first = [push("limited", {"key": "a", "n": n}).pk for n in range(2)]
    w.claim(10)
    later = push("limited", {"key": "a", "n": 9}).pk
    assert w.claim(10) == [] and states("a")[later] == BLOCKED
    assert set(first) <= set(Job.objects.filter(status=RUNNING).values_list("pk", flat=True))


def test_a_rate_delays_what_exceeds_it_and_uses_no_attempt():
    jobs = [push("rated", {"key": "r", "n": n}).pk for n in range(8)]
    w = worker()
    before = db_now()
    assert len(w.claim(20)) == 5  # five starts a second
    late = Job.objects.filter(pk__in=jobs, status=READY)
    assert late.count() == 3 and set(late.values_list("attempt", flat=True)) == {0}
    # They wait until the oldest start leaves the one-second window.
    assert all(before + timedelta(seconds=0.9) <= job.run_at <= before + timedelta(seconds=2)
               for job in late)
    assert w.claim(20) == []


def test_an_operators_rule_overrides_the_handler_and_a_push_may_too():
    LimitRule.objects.create(prefix="site:", concurrency=1)
    ruled = [push("limited", {"key": "site:x", "n": n}).pk for n in range(3)]
    pushed = [push("noop", {"n": n}, limit_key="api", concurrency=1).pk for n in range(3)]
    w = worker()
    taken = {job.id for job in w.claim(20)}
    assert taken == {ruled[0], pushed[0]}
    assert Job.objects.get(pk=pushed[0]).limit_key == "api"


def test_the_unblock_pass_frees_what_a_raised_limit_allows():
    jobs = [push("limited", {"key": "a", "n": n}).pk for n in range(6)]
    w = worker()
    w.claim(10)
    assert list(states("a").values()).count(BLOCKED) == 4
    LimitRule.objects.create(prefix="a", concurrency=4)
    limits_module.forget_rules()
    assert limits_module.unblock_pass("default") == {"a": 4}
    assert list(states("a").values()).count(READY) == 2
    assert {job.id for job in w.claim(10)} == set(jobs[2:4])


def test_handing_back_and_recovery_free_a_keys_slots():
    jobs = [push("limited", {"key": "a", "n": n}).pk for n in range(4)]
    w = worker()
    w.claim(10)
    w.hand_back()  # a graceful stop: the two running go back, and two blocked are ready again
    assert list(states("a").values()).count(RUNNING) == 0
    assert list(states("a").values()).count(BLOCKED) == 0
    other = worker()
    other.claim(10)
    Job.objects.filter(status=RUNNING).update(expires_at=db_now() - timedelta(seconds=5))  # its worker died
    assert JobWorker(queues=["default"]).recover() == 2
    assert list(states("a").values()).count(RUNNING) == 0 and len(jobs) == 4


def test_a_key_can_come_from_the_payload_and_push_many_keeps_it():
    push_many([("limited", {"key": "k1", "n": 1}), ("limited", {"key": "k2", "n": 2})])
    assert sorted(Job.objects.values_list("limit_key", "concurrency", "rate")) == [("k1", 2, ""), ("k2", 2, "")]
    push("rated", {"key": "r", "n": 1})
    assert Job.objects.get(limit_key="r").rate == "5/s"


@pytest.mark.parametrize("text, parsed", [("10/m", (10, 60.0)), ("1/s", (1, 1.0)), (" 3 / h ", (3, 3600.0))])
def test_rates(text, parsed):
    assert parse_rate(text) == parsed
    assert check_rate(text) == f"{parsed[0]}/{ {1.0: 's', 60.0: 'm', 3600.0: 'h'}[parsed[1]] }".replace(" ", "")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: handler("x.bad", concurrency=0), "concurrency must be a whole number from 1"),
        (lambda: handler("x.bad", concurrency=-1), "concurrency must be a whole number"),
        (lambda: handler("x.bad", concurrency=2.5), "concurrency must be a whole number"),
        (lambda: handler("x.bad", rate="ten per minute"), "rate must be N/s, N/m or N/h"),
        (lambda: handler("x.bad", rate="5/fortnight"), "rate must be N/s, N/m or N/h"),
        (lambda: handler("x.bad", rate="0/s"), "rate must be N/s, N/m or N/h with N a whole number >= 1"),
        (lambda: handler("x.bad", limit_key=5), "limit_key must be a string"),
        (lambda: handler("x.bad", limit_key="k" * 256), "limit_key"),
        (lambda: push("noop", {}, limit_key=["a"]), "limit_key must be a string"),
        (lambda: push("noop", {}, limit_key="x" * 300), "limit_key"),
        (lambda: push("noop", {}, limit_key="a\x00b"), "limit_key"),
        (lambda: push("noop", {}, concurrency=0), "concurrency must be"),
        (lambda: push("noop", {}, rate="3/d"), "rate must be"),
        (lambda: push("limited", {"no key": 1}), "limit_key function failed for this payload: KeyError"),
    ],
)
def test_bad_limits_are_refused_at_definition_or_push_and_write_nothing(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not Job.objects.exists()


# -- the admin ------------------------------------------------------------------------


def test_the_admin_lists_keys_at_their_limit_and_what_waits_behind_each(admin_client):
    from django.urls import reverse

    from tests.helpers import table

    [push("limited", {"key": "busy", "n": n}) for n in range(5)]
    push("limited", {"key": "calm", "n": 0})
    worker().claim(10)
    rows = table(admin_client.get(reverse("admin:leases_tasks_limitkey_changelist")), "name")
    assert list(rows) == ["busy", "calm"]  # the most blocked first
    busy, calm = rows["busy"], rows["calm"]
    assert (busy["running"], busy["blocked"], busy["ready"], busy["concurrency"]) == ("2", "3", "0", "2")
    assert (calm["running"], calm["blocked"]) == ("1", "0")
    jobs = admin_client.get(reverse("admin:leases_tasks_job_changelist"), {"limit_key": "busy", "status__exact": BLOCKED})
    assert len(table(jobs, "id")) == 3


def test_a_rule_made_in_the_admin_is_checked_and_applies_at_once(admin_client):
    from django.urls import reverse

    add = reverse("admin:leases_tasks_limitrule_add")
    bad = admin_client.post(add, {"prefix": "site:", "concurrency": "", "rate": "5/fortnight"})
    assert bad.status_code == 200 and "rate must be N/s, N/m or N/h" in bad.content.decode()
    assert "give a concurrency, a rate or both" in admin_client.post(
        add, {"prefix": "site:", "concurrency": "", "rate": ""}).content.decode()
    assert admin_client.post(add, {"prefix": "site:", "concurrency": "1", "rate": " 3 / m "}).status_code == 302
    assert LimitRule.objects.get().rate == "3/m"
    jobs = [push("limited", {"key": "site:a", "n": n}).pk for n in range(3)]
    assert [job.id for job in worker().claim(10)] == jobs[:1]  # no wait for the rules' cache
