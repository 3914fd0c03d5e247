"""The resources admin: live state by the database clock, engine-backed actions, masking."""
from __future__ import annotations

import time
from datetime import timedelta
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import leases.admin
from leases import LeaseLost, Pool
from leases.admin import MASK, ResourceAdmin
from leases.models import Resource
from leases.pool import db_now

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:leases_resource_changelist")


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """admin_user is created with a password; the default hasher is slow on purpose."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


class _Rows(HTMLParser):
    """Cells of the changelist table: {column: text, column.title: hover text} per row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.column: str | None = None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "tr":
            self.rows.append({})
        elif tag in ("td", "th") and self.rows:
            self.column = next((c[6:] for c in classes if c.startswith("field-")), None)
            if self.column:
                self.rows[-1][self.column] = ""
        elif self.column and dict(attrs).get("title"):
            self.rows[-1][self.column + ".title"] = dict(attrs)["title"]

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.column = None

    def handle_data(self, data):
        if self.column:
            self.rows[-1][self.column] += data


def rows(response) -> dict[str, dict[str, str]]:
    assert response.status_code == 200
    html = response.content.decode()
    table = html[html.index('id="result_list"') :] if 'id="result_list"' in html else ""
    parser = _Rows()
    parser.feed(table[: table.find("</table>")])
    return {r["name"].strip(): {k: v.strip() for k, v in r.items()} for r in parser.rows if "name" in r}


@pytest.fixture
def world():
    """proxies: held (by worker-7), free (a lapsed lease), quarantined; accounts: alice."""
    proxies = Pool("proxies")
    proxies.add("held", data={"url": "http://h"})
    lease = proxies.acquire(ttl=600, holder="worker-7")  # the only resource so far
    proxies.add("free", data={"url": "http://f"})
    proxies.acquire(ttl=0.1, holder="gone")  # expires, leaving its holder in the row
    time.sleep(0.15)
    proxies.add("quarantined")
    proxies.quarantine("quarantined", 3600, reason="banned by target")
    Pool("accounts").add("alice", data={"login": "alice"})
    return lease


def test_changelist_shows_live_state_holder_expiry_and_quarantine(admin_client, world):
    table = rows(admin_client.get(CHANGELIST))
    assert set(table) == {"held", "free", "quarantined", "alice"}
    held, free, quarantined = table["held"], table["free"], table["quarantined"]

    assert held["state"].endswith("held")
    assert held["current_holder"] == world.holder
    assert 590 <= int(held["expires_in"]) <= 600
    assert held["token"] == str(world.token)
    assert held["acquired"] != "-"

    assert free["state"].endswith("free")
    assert Resource.objects.get(name="free").holder.startswith("gone:")  # lapsed, so hidden
    assert free["current_holder"] == free["expires_in"] == "-"

    assert quarantined["state"].endswith("quarantined")
    assert quarantined["reason"] == "banned by target"
    assert quarantined["quarantine_until"] != "-"
    assert quarantined["expires_in"] == "-"


def test_state_is_judged_by_the_database_clock_not_the_web_servers(admin_client, world, monkeypatch):
    real = leases.admin.db_now
    monkeypatch.setattr(leases.admin, "db_now", lambda using=None: real(using) + timedelta(hours=2))
    table = rows(admin_client.get(CHANGELIST))
    assert {name: row["state"][-4:] for name, row in table.items()} == dict.fromkeys(table, "free")
    assert rows(admin_client.get(CHANGELIST, {"state": "held"})) == {}


@pytest.mark.parametrize(
    "state, names",
    [("free", {"free", "alice"}), ("held", {"held"}), ("quarantined", {"quarantined"})],
)
def test_state_filter(admin_client, world, state, names):
    assert set(rows(admin_client.get(CHANGELIST, {"state": state}))) == names


def test_pool_filter_lists_the_pools_and_filters(admin_client, world):
    response = admin_client.get(CHANGELIST, {"pool": "accounts"})
    assert set(rows(response)) == {"alice"}
    assert "?pool=proxies" in response.content.decode()  # the filter offers each pool
    assert set(rows(admin_client.get(CHANGELIST, {"pool": "proxies", "state": "free"}))) == {"free"}


@pytest.mark.parametrize(
    "q, names",
    [("accounts", {"alice"}), ("quarant", {"quarantined"}), ("worker-7", {"held"})],
)
def test_search_by_pool_name_and_holder(admin_client, world, q, names):
    assert set(rows(admin_client.get(CHANGELIST, {"q": q}))) == names


def act(client, action, *names):
    ids = [Resource.objects.get(name=n).pk for n in names]
    response = client.post(CHANGELIST, {"action": action, "_selected_action": ids}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def test_release_frees_the_lease_through_the_engine(admin_client, world):
    token = world.token
    assert act(admin_client, "release_selected", "held", "free") == [
        "Released 1 of 2 selected resources. 1 not held."
    ]
    with pytest.raises(LeaseLost):
        world.renew()
    assert Resource.objects.get(name="held").token == token + 1  # fenced
    assert Pool("proxies").stats() == {"free": 2, "held": 0, "quarantined": 1, "total": 3}


def test_quarantine_and_unquarantine_through_the_engine(admin_client, admin_user, world):
    assert act(admin_client, "quarantine_selected", "held", "free") == [
        "Quarantined 2 of 2 selected resources."
    ]
    assert Pool("proxies").stats() == {"free": 0, "held": 0, "quarantined": 3, "total": 3}
    with pytest.raises(LeaseLost):
        world.renew()
    row = Resource.objects.get(name="free")
    assert row.quarantine_reason == f"quarantined from the admin by {admin_user.username}"
    assert timedelta(hours=23) < row.quarantined_until - db_now() <= timedelta(days=1)
    assert set(rows(admin_client.get(CHANGELIST, {"state": "quarantined"}))) == {
        "held", "free", "quarantined"
    }

    assert act(admin_client, "unquarantine_selected", "held", "quarantined", "alice") == [
        "Unquarantined 2 of 3 selected resources. 1 not quarantined."
    ]
    assert Pool("proxies").stats() == {"free": 2, "held": 0, "quarantined": 1, "total": 3}


def test_secrets_are_masked_in_the_list_and_other_keys_are_not(admin_client):
    accounts = Pool("accounts")
    accounts.add("bob", data={"login": "bob", "Password": "hunter2", "api_key": "AK-1",
                              "proxy": "http://bob:pw-789@10.0.0.1:3128"})
    accounts.add("dave", data={"n": [{"auth_token": "tok-4", "region": "eu"}, {"c": {"SECRET": {"x": 1}}}]})
    table = rows(admin_client.get(CHANGELIST))
    for row in table.values():  # the cell is cut short; the hover text has all of it
        assert "hunter2" not in row["data_preview"] and "tok-4" not in row["data_preview"]
    bob, dave = (table[name]["data_preview.title"] for name in ("bob", "dave"))
    assert bob == (f'{{"Password": "{MASK}", "api_key": "{MASK}", "login": "bob",'
                   f' "proxy": "http://bob:{MASK}@10.0.0.1:3128"}}')
    assert dave == f'{{"n": [{{"auth_token": "{MASK}", "region": "eu"}}, {{"c": {{"SECRET": "{MASK}"}}}}]}}'


def test_change_form_edits_pool_name_data_and_shows_lease_state_read_only(admin_client, world):
    row = Resource.objects.get(name="held")
    url = reverse("admin:leases_resource_change", args=[row.pk])
    response = admin_client.get(url)
    assert response.status_code == 200
    assert set(response.context["adminform"].form.fields) == {"pool", "name", "data"}
    readonly = response.context["adminform"].readonly_fields
    assert {"token", "busy_before", "holder", "quarantined_until"} <= set(readonly)
    assert world.holder in response.content.decode()

    posted = {"pool": "proxies", "name": "held2", "data": '{"url": "http://h2"}',
              "token": "999", "holder": "intruder", "busy_before_0": "2000-01-01"}
    assert admin_client.post(url, posted).status_code == 302
    row.refresh_from_db()
    assert (row.name, row.data, row.token, row.holder) == ("held2", {"url": "http://h2"}, world.token,
                                                           world.holder)
    world.renew()  # still ours


def test_add_form_takes_pool_name_and_data_only(admin_client):
    url = reverse("admin:leases_resource_add")
    assert set(admin_client.get(url).context["adminform"].form.fields) == {"pool", "name", "data"}
    response = admin_client.post(url, {"pool": "p", "name": "n", "data": '{"a": 1}'})
    assert response.status_code == 302
    assert Pool("p").stats()["free"] == 1
    assert Pool("p").acquire().resource == {"a": 1}

    response = admin_client.post(url, {"pool": "p", "name": "nan", "data": '{"a": NaN}'})
    assert response.status_code == 200  # the form says why, instead of a database error
    assert "data must be JSON-serialisable" in str(response.context["adminform"].form.errors)
    assert not Resource.objects.filter(name="nan").exists()


def test_saving_the_change_form_does_not_write_back_stale_lease_state(admin_client, monkeypatch):
    pool = Pool("proxies")
    pool.add("a")
    url = reverse("admin:leases_resource_change", args=[Resource.objects.get(name="a").pk])
    claimed = []
    original = ResourceAdmin.get_object

    def read_then_a_worker_claims(self, *args, **kwargs):
        obj = original(self, *args, **kwargs)
        if obj is not None and not claimed:
            claimed.append(pool.acquire(ttl=600))  # between the admin's read and its save
        return obj

    monkeypatch.setattr(ResourceAdmin, "get_object", read_then_a_worker_claims)
    assert admin_client.post(url, {"pool": "proxies", "name": "a", "data": '{"v": 2}'}).status_code == 302
    claimed[0].renew()  # a full save would have put back token 0 and busy_before in 2000
    assert Resource.objects.get(name="a").data == {"v": 2}


def test_view_only_users_see_data_masked_in_the_change_form(client, admin_client):
    Pool("accounts").add("carol", data={"login": "carol", "password": "s3cret-pw"})
    url = reverse("admin:leases_resource_change", args=[Resource.objects.get(name="carol").pk])
    assert "s3cret-pw" in admin_client.get(url).content.decode()  # editors need the value

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_resource"))
    client.force_login(viewer)
    html = client.get(url).content.decode()
    assert "s3cret-pw" not in html
    assert MASK in html and "carol" in html


def test_changelist_queries_do_not_grow_with_rows_and_read_the_clock_once(admin_client, monkeypatch):
    clock_reads = []
    real = leases.admin.db_now
    monkeypatch.setattr(leases.admin, "db_now", lambda using=None: clock_reads.append(1) or real(using))

    def count(expected_rows):
        clock_reads.clear()
        with CaptureQueriesContext(connection) as queries:
            assert len(rows(admin_client.get(CHANGELIST, {"state": "held"}))) == expected_rows
        assert len(clock_reads) == 1
        return len(queries)

    pool = Pool("proxies")
    pool.add("r0")
    pool.acquire(ttl=600)
    few = count(1)
    pool.add_many((f"r{i}", {"i": i}) for i in range(1, 13))
    for _ in range(12):
        pool.acquire(ttl=600)
    assert count(13) == few


# -- locks ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_lock_changelist_shows_owner_and_expiry_and_breaks_locks(admin_client):
    from leases import LeaseLost
    from leases.locks import acquire_lock
    from leases.models import Lock

    held = acquire_lock("rebuild:crawl", ttl=120)
    acquire_lock("old", ttl=0.1).release()
    page = admin_client.get("/admin/leases/lock/").content.decode()
    assert "rebuild:crawl" in page and held.holder in page
    assert ">119<" in page or ">120<" in page
    old = Lock.objects.get(name="old")
    response = admin_client.post(
        "/admin/leases/lock/",
        {"action": "break_selected", "_selected_action": [Lock.objects.get(name="rebuild:crawl").pk, old.pk]},
        follow=True,
    )
    assert "Broke 1 of 2 selected locks. 1 not held." in response.content.decode()
    with pytest.raises(LeaseLost):
        held.extend()
    assert held.holder not in admin_client.get("/admin/leases/lock/").content.decode()
