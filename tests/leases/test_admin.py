"""The resources admin: live state by the database clock, engine-backed actions, masking."""
from __future__ import annotations

import re
import string
import time
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import leases.ops.adminkit
from leases import LeaseLost, Pool
from leases.admin.resources import ResourceAdmin
from leases.clock import db_now
from leases.models import Resource
from leases.ops.masking import MASK, SECRET_WORDS, is_secret, mask_secrets, mask_text
from tests.helpers import Rows

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:leases_resource_changelist")



def rows(response) -> dict[str, dict[str, str]]:
    assert response.status_code == 200
    html = response.content.decode()
    table = html[html.index('id="result_list"') :] if 'id="result_list"' in html else ""
    parser = Rows()
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

    # Why and until when, in the state cell; the seconds left where a lease's would be.
    assert re.fullmatch(r"● quarantined: banned by target \(until \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\)",
                        quarantined["state"])
    assert 3590 <= int(quarantined["expires_in"]) <= 3600


def test_state_is_judged_by_the_database_clock_not_the_web_servers(admin_client, world, monkeypatch):
    real = leases.ops.adminkit.db_now
    monkeypatch.setattr(leases.ops.adminkit, "db_now", lambda using=None: real(using) + timedelta(hours=2))
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
    assert Pool("proxies").stats() == {"free": 2, "held": 0, "cooling": 0, "quarantined": 1, "total": 3}


def test_quarantine_asks_how_long_and_why_then_goes_through_the_engine(admin_client, admin_user, world):
    ids = [Resource.objects.get(name=name).pk for name in ("held", "free")]
    asked = admin_client.post(CHANGELIST, {"action": "quarantine_selected", "_selected_action": ids})
    page = asked.content.decode()
    assert asked.status_code == 200 and "proxies/held" in page and 'name="reason"' in page
    assert Pool("proxies").stats()["quarantined"] == 1  # nothing done yet
    bad = admin_client.post(CHANGELIST, {"action": "quarantine_selected", "_selected_action": ids, "apply": "1",
                                         "duration": "soon", "reason": "x"})
    assert "not a duration" in bad.content.decode() and Pool("proxies").stats()["quarantined"] == 1
    done = admin_client.post(CHANGELIST, {"action": "quarantine_selected", "_selected_action": ids, "apply": "1",
                                          "duration": "2h", "reason": "captcha wall"}, follow=True)
    assert [str(m) for m in done.context["messages"]] == ["Quarantined 2 of 2 selected resources."]
    assert Pool("proxies").stats() == {"free": 0, "held": 0, "cooling": 0, "quarantined": 3, "total": 3}
    with pytest.raises(LeaseLost):
        world.renew()
    row = Resource.objects.get(name="free")
    assert row.quarantine_reason == "captcha wall"
    assert timedelta(hours=1, minutes=59) < row.quarantined_until - db_now() <= timedelta(hours=2)
    history = LogEntry.objects.get(object_id=str(row.pk))
    assert (history.user, history.change_message) == (admin_user, "Quarantined from the admin for 2h: captcha wall.")
    assert set(rows(admin_client.get(CHANGELIST, {"state": "quarantined"}))) == {
        "held", "free", "quarantined"
    }

    assert act(admin_client, "unquarantine_selected", "held", "quarantined", "alice") == [
        "Unquarantined 2 of 3 selected resources. 1 not quarantined."
    ]
    assert LogEntry.objects.filter(change_message="Unquarantined from the admin.").count() == 2
    assert Pool("proxies").stats() == {"free": 2, "held": 0, "cooling": 0, "quarantined": 1, "total": 3}


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
    assert {"token", "busy_until", "holder", "quarantined"} <= set(readonly)
    page = response.content.decode()
    assert world.holder in page and "2000-01-01" not in page and "Jan. 1, 2000" not in page  # no placeholder
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", page)

    posted = {"pool": "proxies", "name": "held2", "data": '{"url": "http://h2"}',
              "token": "999", "holder": "intruder", "busy_before_0": "2000-01-01"}
    assert admin_client.post(url, posted).status_code == 302
    row.refresh_from_db()
    assert (row.name, row.data, row.token, row.holder) == ("held2", {"url": "http://h2"}, world.token,
                                                           world.holder)
    world.renew()  # still ours


def test_add_form_takes_pool_name_data_and_slots_only(admin_client):
    url = reverse("admin:leases_resource_add")
    assert set(admin_client.get(url).context["adminform"].form.fields) == {"pool", "name", "data", "slots"}
    response = admin_client.post(url, {"pool": "p", "name": "n", "data": '{"a": 1}', "slots": "1"})
    assert response.status_code == 302
    assert Pool("p").stats()["free"] == 1
    assert Pool("p").acquire().resource == {"a": 1}
    assert admin_client.post(url, {"pool": "p", "name": "acct", "data": '{"b": 2}', "slots": "3"}).status_code == 302
    assert list(Resource.objects.filter(name="acct").values_list("slot", "data")) == [(s, {"b": 2}) for s in range(3)]
    assert admin_client.post(url, {"pool": "p", "name": "x", "data": "{}", "slots": "0"}).status_code == 200

    response = admin_client.post(url, {"pool": "p", "name": "nan", "data": '{"a": NaN}', "slots": "1"})
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
    real = leases.ops.adminkit.db_now
    monkeypatch.setattr(leases.ops.adminkit, "db_now", lambda using=None: clock_reads.append(1) or real(using))

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


# -- masking -------------------------------------------------------------------------------

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("key", [
    "password", "Password", "pass", "PWD", "passwd", "passphrase", "auth", "Authorization", "cookie",
    "credentials", "creds", "session_id", "private_key", "client_secret", "api_key", "X-Auth-Token",
])
def test_secret_keys(key):
    assert is_secret(key)


@pytest.mark.parametrize("key", ["login", "user", "url", "region", "name", "host", "", 3, None])
def test_other_keys_are_not_secret(key):
    assert not is_secret(key)


@pytest.mark.parametrize("text, masked", [
    # URL passwords: with or without a scheme, holding "/", ":" or "@"; the user stays.
    ("http://user:p@ss@host:3128", f"http://user:{MASK}@host:3128"),
    ("http://user:pa/ss@host", f"http://user:{MASK}@host"),
    ("socks5://u:a:b/c@d@10.0.0.1:1080/x", f"socks5://u:{MASK}@10.0.0.1:1080/x"),
    ("proxy user:pass@host:3128 refused", f"proxy user:{MASK}@host:3128 refused"),
    ("redis://:secret@cache:6379/0", f"redis://:{MASK}@cache:6379/0"),
    ("could not connect to 'postgres://app:pw@db/x'", f"could not connect to 'postgres://app:{MASK}@db/x'"),
    ("mailto://me@mail.org:pw@host", f"mailto://me@mail.org:{MASK}@host"),
    ("https://api/x?next=http://u:p@h", f"https://api/x?next=http:{MASK}@h"),  # broad: no p shown
    # Secret-looking names: query strings, keyword arguments, reprs, JSON, headers.
    ("GET /v1?api_key=XYZ&x=1", f"GET /v1?api_key={MASK}&x=1"),
    ("password=hunter2", f"password={MASK}"),
    ("login failed: PWD = hunter2 (twice)", f"login failed: PWD = {MASK} (twice)"),
    ("connect(passwd='hun ter2', user='bob')", f"connect(passwd='{MASK}', user='bob')"),
    ("{'password': 'hunter2', 'user': 'bob'}", f"{{'password': '{MASK}', 'user': 'bob'}}"),
    ('{"Session Id": "s-1", "n": 1}', f'{{"Session Id": "{MASK}", "n": 1}}'),
    ("x?client_secret=a&credentials=b&private_key=c&auth=d&pwd=e",
     f"x?client_secret={MASK}&credentials={MASK}&private_key={MASK}&auth={MASK}&pwd={MASK}"),
    ("Authorization: Bearer eyJhbGci.eyJzdWIi.sig\nnext line", f"Authorization: {MASK}\nnext line"),
    ("Proxy-Authorization: Basic dXNlcjpwYXNz", f"Proxy-Authorization: {MASK}"),
    ("headers Authorization=Bearer abc.def sent", f"headers Authorization={MASK} sent"),
    ("Cookie: sessionid=abc; theme=dark", f"Cookie: {MASK}"),
    ("X-Api-Key: abc123", f"X-Api-Key: {MASK}"),
    ("jwt.InvalidTokenError: token=abc", f"jwt.InvalidTokenError: token={MASK}"),
    ("password: 'a'b", f"password: {MASK}"),  # not a quoted value after all: all of it
    ("monkey=banana", f"monkey={MASK}"),  # deliberately broad
])
def test_mask_text_masks_credentials(text, masked):
    assert mask_text(text) == masked


@pytest.mark.parametrize("text", [
    "bob@example.com",
    "mail bob@example.com:8080 now",
    "http://host/path",
    "http://host:8080/path?page=2&sort=name",
    "http://bob@host:8080",
    "git@github.com:org/repo.git",
    "KeyError: 'token'",
    ('Traceback (most recent call last):\n  File "/app/keys.py", line 3, in get_key\n'
     "    return d[key]\nKeyError: 'x'"),
    "ratio 1:2 at noon, url=http://h/x",
])
def test_mask_text_leaves_the_rest_alone(text):
    assert mask_text(text) == text


def test_mask_secrets_masks_secret_keys_whole_and_strings_as_text():
    value = {
        "pass": "x", "Cookie": {"a": 1}, "auth": ["t"], "region": "eu", "n": 3,
        "proxies": ["user:pw@h:3128", {"url": "http://h/?token=t1&x=1", "ok": None}],
    }
    assert mask_secrets(value) == {
        "pass": MASK, "Cookie": MASK, "auth": MASK, "region": "eu", "n": 3,
        "proxies": [f"user:{MASK}@h:3128", {"url": f"http://h/?token={MASK}&x=1", "ok": None}],
    }


plain = st.text(string.ascii_lowercase + string.digits + ".-", min_size=1, max_size=10).filter(
    lambda s: not is_secret(s)
)
words = st.lists(st.text(string.ascii_letters, min_size=1, max_size=8), max_size=3).map(" ".join).filter(
    lambda s: not is_secret(s)  # "key :pw@h" is the name key and its value
)
non_space = st.characters(exclude_categories=("Z", "C"))


@EXAMPLES
@given(scheme=st.sampled_from(["", "http://", "socks5h://", "postgres://"]), user=plain | st.just(""),
       password=st.text(non_space, min_size=1, max_size=20), host=plain,
       port=st.sampled_from(["", ":3128", ":3128/x"]), before=words, after=words)
def test_a_url_password_is_masked_whatever_it_holds(scheme, user, password, host, port, before, after):
    assume(scheme or not password.startswith("//"))  # "u://x@h" reads as a URL without one
    text = f"{before} {scheme}{user}:{password}@{host}{port} {after}"
    assert mask_text(text) == f"{before} {scheme}{user}:{MASK}@{host}{port} {after}"


secret_names = st.builds(
    lambda before, word, after, quote: f"{quote}{before}{word}{after}{quote}",
    st.text(string.ascii_lowercase + "_-.", max_size=4),
    st.sampled_from(SECRET_WORDS).flatmap(lambda w: st.sampled_from([w, w.upper(), w.title()])),
    st.text(string.ascii_lowercase + "_", max_size=4),
    st.sampled_from(["", "'", '"']),
)


@EXAMPLES
@given(name=secret_names, sep=st.sampled_from(["=", " = ", ":", ": "]),
       value=st.text(non_space.filter(lambda c: c != "&"), min_size=1, max_size=20))
def test_a_secret_names_value_is_never_shown(name, sep, value):
    assume(not value.startswith("="))  # "name==x" is the name, "==" and x
    prefix, suffix = f"x {name}{sep}", "&next=1 end"
    masked = mask_text(f"{prefix}{value}{suffix}")
    quoted = {f"{prefix}{q}{MASK}{q}{suffix}" for q in "'\""}
    if "=" in sep:  # one value, up to the next parameter
        assert masked in {f"{prefix}{MASK}{suffix}", *quoted}
    else:  # a header's value: the rest of the line
        assert masked in {f"{prefix}{MASK}", *quoted}


@EXAMPLES
@given(st.text())
def test_text_without_an_at_sign_or_a_secret_word_is_left_alone(text):
    assume("@" not in text and not is_secret(text))
    assert mask_text(text) == text


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
    states = {row["name"]: row["state"] for row in rows(admin_client.get("/admin/leases/lock/")).values()}
    assert states == {"rebuild:crawl": "● held", "old": "● free"}
    old = Lock.objects.get(name="old")
    response = admin_client.post(
        "/admin/leases/lock/",
        {"action": "break_selected", "_selected_action": [Lock.objects.get(name="rebuild:crawl").pk, old.pk]},
        follow=True,
    )
    assert "Broke 1 of 2 selected locks. 1 not held." in response.content.decode()
    entry = LogEntry.objects.get()
    assert entry.object_repr == "rebuild:crawl" and entry.change_message == (
        f"Broken from the admin (held by {held.holder}).")
    with pytest.raises(LeaseLost):
        held.extend()
    assert held.holder not in admin_client.get("/admin/leases/lock/").content.decode()
