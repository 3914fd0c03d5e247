"""What each target says of each resource, in the admin: the resource page's per-target
section (markup, not escaped text), the list of verdicts with its filters and search, the
lifts (per resource and per target, through leases.targets, named in the history), who
may see and who may lift, and bad input."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leases import Pool, targets
from leases.clock import db_now
from leases.models import Resource, ResourceTarget
from leases.ops.masking import MASK
from tests.helpers import table

pytestmark = pytest.mark.django_db

VERDICTS = reverse("admin:leases_resourcetarget_changelist")
RESOURCES = reverse("admin:leases_resource_changelist")
TIME = r'<span style="white-space: nowrap">\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ</span>'


@pytest.fixture
def verdicts():
    """proxies p1: banned by a.example (a reason quoting a proxy's password), rested by
    b.example; p2: paced by a.example, a ban by c.example long passed; accounts acct: banned
    by a.example."""
    proxies = Pool("proxies")
    proxies.add("p1", data={"proxy": "http://u:PROXYPW-9@h:3128"})
    proxies.add("p2")
    Pool("accounts").add("acct")
    targets.ban("proxies", "p1", "a.example", 600, reason="403 via http://u:REASONPW-1@h:3128")
    targets.rest("proxies", "p1", "b.example", 300)
    now = db_now()
    ResourceTarget.objects.create(pool="proxies", name="p2", target="a.example", next_start_at=now + timedelta(hours=1),
                                  updated_at=now)
    ResourceTarget.objects.create(pool="proxies", name="p2", target="c.example", banned_until=now - timedelta(days=1),
                                  ban_reason="old", updated_at=now - timedelta(days=1))
    targets.ban("accounts", "acct", "a.example", 600, reason="captcha")


def user(client, *codenames: str) -> User:
    found = User.objects.create_user("-".join(codenames) or "nobody", password="pw", is_staff=True)
    found.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client.force_login(found)
    return found


def listed(client, **params) -> dict[tuple[str, str], dict[str, str]]:
    return table(client.get(VERDICTS, params), "resource", "target")


def resource_page(client, name: str) -> str:
    pk = Resource.objects.get(name=name, slot=0).pk
    return client.get(reverse("admin:leases_resource_change", args=[pk])).content.decode()


def test_the_resource_pages_per_target_section_is_markup_not_escaped_text(admin_client, verdicts):
    page = resource_page(admin_client, "p1")
    assert re.search(rf"<div>a\.example: banned until {TIME}: 403 via http://u:REASONPW-1@h:3128</div>", page)
    assert re.search(rf"<div>b\.example: resting until {TIME}</div>", page)
    assert "&lt;span" not in page
    passed = resource_page(admin_client, "p2")
    assert re.search(rf"<div>a\.example: paced until {TIME}</div>", passed)
    assert "<div>c.example: nothing now</div>" in passed


def test_the_section_links_to_the_resources_verdicts(admin_client, verdicts):
    page = resource_page(admin_client, "p1")
    link = re.search(r'<a href="([^"]+)">each target\'s verdict, to lift one</a>', page)
    assert link and link[1].startswith(VERDICTS)
    rows = table(admin_client.get(link[1].replace("&amp;", "&")), "resource", "target")
    assert set(rows) == {("p1", "a.example"), ("p1", "b.example")}


def test_the_list_says_what_holds_until_when_and_why(admin_client, verdicts):
    rows = listed(admin_client)
    assert set(rows) == {("p1", "a.example"), ("p1", "b.example"), ("p2", "a.example"), ("p2", "c.example"),
                         ("acct", "a.example")}
    banned = rows[("p1", "a.example")]
    assert (banned["pool"], banned["holds"], banned["reason"]) == ("proxies", "banned",
                                                                   "403 via http://u:REASONPW-1@h:3128")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", banned["until"])
    assert banned["until.title"].startswith("banned until ")
    assert rows[("p1", "b.example")]["holds"] == "resting"
    assert rows[("p2", "a.example")]["holds"] == "paced"
    assert rows[("p2", "c.example")]["holds"] == "nothing now (passed)" and rows[("p2", "c.example")]["until"] == "-"
    page = admin_client.get(VERDICTS).content.decode()
    p1 = Resource.objects.get(name="p1").pk
    assert f'<a href="{reverse("admin:leases_resource_change", args=[p1])}">p1</a>' in page
    assert "PROXYPW-9" not in page  # the resource's data is not shown here


def test_a_verdict_whose_resource_was_removed_says_so(admin_client, verdicts):
    Pool("accounts").remove("acct")
    assert listed(admin_client)[("acct (removed)", "a.example")]["holds"] == "banned"


@pytest.mark.parametrize("params, expected", [
    ({"state": "banned"}, {("p1", "a.example"), ("acct", "a.example")}),
    ({"state": "resting"}, {("p1", "b.example")}),
    ({"state": "paced"}, {("p2", "a.example")}),
    ({"state": "passed"}, {("p2", "c.example")}),
    ({"pool": "accounts"}, {("acct", "a.example")}),
    ({"target": "a.example"}, {("p1", "a.example"), ("p2", "a.example"), ("acct", "a.example")}),
    ({"target": "c.example"}, {("p2", "c.example")}),
    ({"pool": "proxies", "target": "a.example", "state": "banned"}, {("p1", "a.example")}),
    ({"q": "p2"}, {("p2", "a.example"), ("p2", "c.example")}),
    ({"q": "b.exa"}, {("p1", "b.example")}),
])
def test_filters_by_pool_target_and_state_and_search_by_resource_and_target(admin_client, verdicts, params,
                                                                            expected):
    assert set(listed(admin_client, **params)) == expected


def test_the_filters_offer_the_pools_and_the_targets_of_the_pool_chosen_or_of_the_bans_in_force(admin_client,
                                                                                               verdicts):
    def offered(**params) -> set[str]:
        page = admin_client.get(VERDICTS, params).content.decode()
        return set(re.findall(r"(?:\?|&amp;)target=([a-z.]+)", page))

    page = admin_client.get(VERDICTS).content.decode()
    assert "?pool=accounts" in page and "?pool=proxies" in page
    assert offered() == {"a.example"}  # c.example's ban passed, b.example only rests
    assert offered(pool="proxies") == {"a.example", "b.example", "c.example"}
    assert offered(pool="accounts") == {"a.example"}


def test_the_count_stops_at_its_limit(admin_client, verdicts, monkeypatch):
    monkeypatch.setattr(admin.site._registry[ResourceTarget], "count_limit", 3)
    assert "3+ resource targets" in admin_client.get(VERDICTS).content.decode()
    assert "2 resource targets" in admin_client.get(VERDICTS, {"state": "banned"}).content.decode()


def test_the_lists_queries_do_not_grow_with_its_rows(admin_client):
    def queries(expected: int) -> int:
        with CaptureQueriesContext(connection) as captured:
            assert len(listed(admin_client)) == expected
        return len(captured)

    Pool("proxies").add("p0")
    targets.ban("proxies", "p0", "t0.example", 600)
    few = queries(1)
    for n in range(1, 13):
        Pool("proxies").add(f"p{n}")
        targets.ban("proxies", f"p{n}", f"t{n}.example", 600, reason="403")
    assert queries(13) == few


def test_state_is_judged_by_the_database_clock(admin_client, verdicts, monkeypatch):
    import leases.ops.adminkit

    real = leases.ops.adminkit.db_now
    monkeypatch.setattr(leases.ops.adminkit, "db_now", lambda using=None: real(using) + timedelta(hours=2))
    assert {row["holds"] for row in listed(admin_client).values()} == {"nothing now (passed)"}
    assert set(listed(admin_client, state="banned")) == set()


def act(client, url: str, action: str, pks: list[int]):
    return client.post(url, {"action": action, "_selected_action": pks}, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_lifting_a_verdict_lifts_that_targets_ban_and_rest_only_and_names_both_in_the_history(admin_client,
                                                                                               verdicts):
    targets.rest("proxies", "p1", "a.example", 600)  # banned and resting for a.example
    chosen = ResourceTarget.objects.filter(name__in=["p1", "p2"], target="a.example").order_by("name")
    done = act(admin_client, VERDICTS, "lift_selected", [row.pk for row in chosen])
    assert messages_of(done) == ["Lifted 1 of 2 selected verdicts. 1 neither banned nor resting."]
    assert not targets.unusable_now("proxies", "a.example", ["p1"])
    assert set(targets.unusable_now("proxies", "b.example", ["p1"])) == {"p1"}  # another target's rest stays
    assert set(targets.unusable_now("accounts", "a.example", ["acct"])) == {"acct"}
    assert set(targets.unusable_now("proxies", "a.example", ["p2"])) == {"p2"}  # a pace is not lifted
    message = "Lifted the ban and rest of proxies/p1 for target a.example from the admin."
    entries = LogEntry.objects.filter(change_message=message)
    assert {(entry.content_type.model, entry.object_id) for entry in entries} == {
        ("resourcetarget", str(chosen[0].pk)), ("resource", str(Resource.objects.get(name="p1").pk))}
    assert LogEntry.objects.count() == 2


def test_lifting_a_resources_every_target_names_the_resource_and_its_targets_in_the_history(admin_client,
                                                                                             verdicts):
    pks = [Resource.objects.get(name=name).pk for name in ("p1", "p2")]
    done = act(admin_client, RESOURCES, "lift_selected", pks)
    assert messages_of(done) == [("Lifted the per-target bans and rests of 1 of 2 selected resources. "
                                  "1 neither banned nor rested by any target.")]
    assert not targets.unusable_now("proxies", "a.example", ["p1"]) and not targets.unusable_now(
        "proxies", "b.example", ["p1"])
    (entry,) = LogEntry.objects.all()
    assert entry.object_id == str(pks[0]) and entry.change_message == (
        "Lifted the per-target bans and rests of proxies/p1 from the admin (every target: a.example, b.example).")


def test_viewers_of_resources_see_the_verdicts_with_reasons_masked_and_cannot_lift(client, verdicts):
    user(client, "view_resource")
    response = client.get(VERDICTS)
    page = response.content.decode()
    assert response.status_code == 200 and "REASONPW-1" not in page and f"http://u:{MASK}@h:3128" in page
    assert 'name="_selected_action"' not in page  # no action to choose
    assert "REASONPW-1" not in resource_page(client, "p1")
    verdict = ResourceTarget.objects.get(name="p1", target="a.example").pk
    page = client.get(reverse("admin:leases_resourcetarget_change", args=[verdict])).content.decode()
    assert "a.example" in page and "REASONPW-1" not in page and f"http://u:{MASK}@h:3128" in page
    pk = ResourceTarget.objects.get(name="p1", target="a.example").pk
    act(client, VERDICTS, "lift_selected", [pk])
    assert set(targets.unusable_now("proxies", "a.example", ["p1"])) == {"p1"}
    assert not LogEntry.objects.exists()


def test_who_may_change_resources_lifts_and_reads_reasons_as_stored(client, verdicts):
    user(client, "view_resource", "change_resource")
    assert "REASONPW-1" in client.get(VERDICTS).content.decode()
    pk = ResourceTarget.objects.get(name="p1", target="a.example").pk
    assert "REASONPW-1" in client.get(reverse("admin:leases_resourcetarget_change", args=[pk])).content.decode()
    assert messages_of(act(client, VERDICTS, "lift_selected", [pk])) == ["Lifted 1 of 1 selected verdict."]
    assert not targets.unusable_now("proxies", "a.example", ["p1"])


def test_others_do_not_see_the_verdicts(client, verdicts):
    user(client, "view_lock")
    assert client.get(VERDICTS).status_code == 403


def test_verdicts_are_neither_added_edited_nor_deleted_here(admin_client, verdicts):
    assert admin_client.get(reverse("admin:leases_resourcetarget_add")).status_code == 403
    pk = ResourceTarget.objects.get(name="p1", target="a.example").pk
    before = ResourceTarget.objects.get(pk=pk).banned_until
    posted = admin_client.post(reverse("admin:leases_resourcetarget_change", args=[pk]),
                               {"banned_until_0": "2000-01-01", "target": "x"})
    assert posted.status_code == 403 and ResourceTarget.objects.get(pk=pk).banned_until == before
    assert admin_client.post(reverse("admin:leases_resourcetarget_delete", args=[pk]), {"post": "yes"}).status_code \
        == 403
    assert "delete_selected" not in admin_client.get(VERDICTS).content.decode()


def test_a_lift_of_verdicts_that_are_gone_or_garbage_changes_nothing(admin_client, verdicts):
    before = list(ResourceTarget.objects.order_by("pk").values())
    for selected in (["999999"], ["abc"], ["-1"], [""], ["1.5"], ["9" * 30]):
        response = admin_client.post(VERDICTS, {"action": "lift_selected", "_selected_action": selected})
        assert response.status_code in (200, 302)
    assert list(ResourceTarget.objects.order_by("pk").values()) == before
    assert not LogEntry.objects.exists()


PARAMS = st.dictionaries(
    st.sampled_from(["state", "pool", "target", "q", "o", "p", "name", "all", "e", "target__in", "_facets"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40),
    max_size=3,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=PARAMS)
def test_any_query_string_gives_a_page_a_redirect_or_a_refusal_never_an_error(admin_client, params):
    response = admin_client.get(VERDICTS, params)
    assert response.status_code in (200, 302, 400)
