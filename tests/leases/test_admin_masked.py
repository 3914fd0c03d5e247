"""What is masked for a user is not searchable, filterable or orderable by that user: the
admins' one declaration of masked fields (`masked`), checked on every changelist of the
installed apps and on the resources' data, and the dashboard's links. The jobs', schedules'
and runs' own cases are in their apps' tests."""
from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.contrib.auth.models import Permission, User
from django.db.models.constants import LOOKUP_SEP
from django.test import RequestFactory
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leases import Pool, targets
from leases.admin.resources import ResourceAdmin
from leases.clock import db_now
from leases.models import Resource
from leases.ops import links
from leases.ops.adminkit import Masking, fields_of
from tests.helpers import listed, staff

pytestmark = pytest.mark.django_db

RESOURCES = reverse("admin:leases_resource_changelist")
VERDICTS = reverse("admin:leases_resourcetarget_changelist")
#: The lookups a guesser would try, on the field or on a JSON key under it.
LOOKUPS = ["", "__exact", "__iexact", "__icontains", "__contains", "__startswith", "__istartswith", "__endswith",
           "__regex", "__iregex", "__in", "__isnull", "__gt", "__lt", "__has_key", "__has_keys", "__contained_by",
           "__password", "__password__startswith", "__password__regex", "__proxy__icontains", "__0",
           "__0__icontains", "__isnull", "__len"]
#: The admins of the installed apps whose pages mask something, and what.
MASKED = [(model, model_admin) for model, model_admin in admin.site._registry.items()
          if model._meta.app_label.startswith("leases") and model_admin.masked]


def url_of(model) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


def view_permission(model) -> str:
    """The view permission that shows the model's list (the verdicts show with the resources')."""
    return "view_resource" if model._meta.model_name == "resourcetarget" else f"view_{model._meta.model_name}"


# -- the declaration ---------------------------------------------------------------------


def test_every_admin_of_the_apps_declares_what_it_masks():
    registered = [model_admin for model, model_admin in admin.site._registry.items()
                  if model._meta.app_label.startswith("leases")]
    assert all(isinstance(model_admin, Masking) for model_admin in registered)
    assert {model._meta.label for model, _ in MASKED} == {
        "leases.Resource", "leases.ResourceTarget", "leases_tasks.Job", "leases_tasks.Schedule",
        "leases_pipelines.Run"}
    for model, model_admin in MASKED:
        for path in model_admin.masked:  # every declared path names fields all the way
            assert len(fields_of(model, path)) == len(path.split(LOOKUP_SEP)), (model, path)


@pytest.mark.parametrize("model, model_admin", MASKED, ids=[model._meta.label for model, _ in MASKED])
def test_a_viewer_may_filter_by_no_masked_field_of_any_list(client, model, model_admin):
    staff(client, view_permission(model))
    url = url_of(model)
    assert listed(client, url)[0] == 200
    for path in model_admin.masked:
        for lookup in LOOKUPS:
            assert listed(client, url, **{f"{path}{lookup}": "x"}) == (400, None), f"{path}{lookup}"


@pytest.mark.parametrize("model, model_admin", MASKED, ids=[model._meta.label for model, _ in MASKED])
def test_who_sees_a_field_as_stored_filters_by_it_as_before(admin_client, model, model_admin):
    for path in model_admin.masked:
        if LOOKUP_SEP in path:
            continue  # a lookup through a relation is refused by the admin to everyone
        for lookup in ("", "__icontains", "__isnull"):
            value = "1" if lookup == "__isnull" else "x"
            assert listed(admin_client, url_of(model), **{f"{path}{lookup}": value})[0] in (200, 302)


def test_a_lookup_the_database_cannot_do_is_a_bad_lookup_not_an_error(admin_client):
    Pool("proxies").add("p1", data={"a": 1})
    response = admin_client.get(RESOURCES, {"data__contains": '{"a": 1}'})
    assert response.status_code in (200, 302)  # PostgreSQL and MariaDB do it; SQLite: ?e=1
    if response.status_code == 302:
        assert response.url.endswith("?e=1")


# -- resources -----------------------------------------------------------------------------


@pytest.fixture
def proxies():
    pool = Pool("proxies")
    pool.add("p1", data={"proxy": "http://u:PROXYPW-9@h:3128", "password": "PROXYPW-9"})
    pool.add("p2", data={"proxy": "http://h2:3128"})


@pytest.mark.parametrize("lookup", ["data__icontains", "data__password__startswith", "data__password",
                                    "data__proxy__icontains", "data__regex", "data__has_key"])
def test_a_viewer_cannot_guess_a_resources_data(client, admin_client, proxies, lookup):
    right, wrong = ("password", "nothing") if lookup.endswith("has_key") else ("PROXYPW-9", "WRONG-0")
    if lookup.endswith("startswith"):
        right, wrong = "PROX", "WRON"
    assert listed(admin_client, RESOURCES, **{lookup: right}) == (200, 1)  # who may change finds it
    assert listed(admin_client, RESOURCES, **{lookup: wrong}) == (200, 0)
    staff(client, "view_resource")
    assert listed(client, RESOURCES, **{lookup: right}) == listed(client, RESOURCES, **{lookup: wrong}) == (400, None)


def test_a_viewers_search_reads_pool_name_and_holder_only(client, proxies):
    staff(client, "view_resource")
    assert listed(client, RESOURCES, q="PROXYPW-9") == listed(client, RESOURCES, q="WRONG-0") == (200, 0)
    assert listed(client, RESOURCES, q="p1") == (200, 1)


def test_a_verdicts_reason_is_masked_for_viewers_and_not_searchable_by_them(client, admin_client, proxies):
    targets.ban("proxies", "p1", "a.example", 600, reason="403 through http://u:PROXYPW-9@h:3128")
    targets.ban("proxies", "p2", "a.example", 600, reason="403")
    assert listed(admin_client, VERDICTS, ban_reason__icontains="PROXYPW-9") == (200, 1)
    staff(client, "view_resource")
    for guess in ("PROXYPW-9", "WRONG-0"):
        assert listed(client, VERDICTS, ban_reason__icontains=guess) == (400, None)
        assert listed(client, VERDICTS, q=guess) == (200, 0)


# -- orderings and date drill-downs, through the declaration --------------------------------


class DataOrdered(ResourceAdmin):
    """A resources' admin with a column ordered by the masked data, and masked acquisition
    times drilled down by date: what a later column or a date hierarchy would be."""

    masked = ("data", "acquired_at")
    date_hierarchy = "acquired_at"

    def get_list_display(self, request):
        return ("name", "data_by_password")

    @admin.display(description="password", ordering="data__password")
    def data_by_password(self, obj):
        return "-"


def changelist_of(user: User, **params):
    request = RequestFactory().get(RESOURCES, params)
    request.user = user
    return DataOrdered(Resource, admin.site).get_changelist_instance(request)


def ordered_by_password(user: User):
    """The list as `user` asks for it ordered by the password column, descending."""
    column = changelist_of(user).list_display.index("data_by_password")
    return changelist_of(user, o=f"-{column}"), column


def test_a_viewer_cannot_order_or_drill_down_by_a_masked_field():
    pool = Pool("proxies")
    for name, password in (("p0", "AAA"), ("p1", "PROXYPW-9"), ("p2", "BBB")):
        pool.add(name, data={"password": password})
    looker = User.objects.create_user("looker", is_staff=True)
    looker.user_permissions.add(Permission.objects.get(codename="view_resource"))
    editor = User.objects.create_superuser("editor")

    def names(user: User) -> list[str]:
        return [row.name for row in ordered_by_password(user)[0].result_list]

    edited, column = ordered_by_password(editor)
    assert edited.get_ordering_field_columns() == {column: "desc"}
    assert "data_by_password" in edited.sortable_by and edited.date_hierarchy == "acquired_at"
    viewed, _ = ordered_by_password(looker)
    assert viewed.get_ordering_field("data_by_password") is None
    assert "data_by_password" not in viewed.sortable_by and viewed.date_hierarchy is None
    before = (names(editor), names(looker))
    assert before[0] == ["p1", "p2", "p0"]
    Resource.objects.filter(name="p0").update(data={"password": "ZZZ"})
    assert names(editor) == ["p0", "p1", "p2"]  # the editor's order follows the passwords
    assert names(looker) == before[1]  # the viewer's does not
    with pytest.raises(DisallowedModelAdminLookup):
        changelist_of(looker, acquired_at__year=str(db_now().year))


# -- the dashboard -------------------------------------------------------------------------


def test_a_dashboard_link_never_filters_by_a_masked_field():
    assert links.changelist("leases.resource", "default", pool__exact="proxies", state="held")
    with pytest.raises(ValueError, match="filters by data__icontains, which its admin masks"):
        links.changelist("leases.resource", "default", data__icontains="x")
    with pytest.raises(ValueError, match="payload__api_key"):
        links.changelist("leases_tasks.job", "default", queue="crawl", payload__api_key="x")


def test_every_drill_down_of_a_viewers_dashboard_opens_for_that_staff(client, proxies):
    import tests.jobs  # noqa: F401 - registers "noop"
    from leases.tasks import push

    push("noop", {"api_key": "PAYKEY-0"})
    Pool("proxies").acquire(ttl=60)
    staff(client, "view_resource", "view_job", "view_queue", "view_run", "view_worker", "view_schedule")
    page = client.get(reverse("leases:dashboard")).content.decode()
    found = {href.replace("&amp;", "&") for href in re.findall(r'href="(/admin/[^"]+\?[^"]+)"', page)}
    assert found  # the panels link to filtered lists
    for href in found:
        assert client.get(href).status_code == 200, href


# -- any lookup, any value -----------------------------------------------------------------

PATHS = [(model, path) for model, model_admin in MASKED for path in model_admin.masked]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.sampled_from(PATHS),
    keys=st.lists(st.from_regex(r"[A-Za-z0-9_]{1,8}", fullmatch=True), max_size=2),
    lookup=st.sampled_from([lookup.lstrip("_") for lookup in LOOKUPS if lookup] + ["search", "trigram_similar",
                                                                                    "unaccent", "date", "year"]),
    value=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20),
)
def test_no_lookup_on_a_masked_field_reaches_a_viewers_list(client, target, keys, lookup, value):
    model, path = target
    if not User.objects.filter(username="guesser").exists():
        viewer_user = User.objects.create_user("guesser", is_staff=True)
        viewer_user.user_permissions.add(*Permission.objects.filter(codename__in=[
            view_permission(model) for model, _ in MASKED]))
    client.force_login(User.objects.get(username="guesser"))
    assert listed(client, url_of(model), **{LOOKUP_SEP.join([path, *keys, lookup]): value}) == (400, None)
