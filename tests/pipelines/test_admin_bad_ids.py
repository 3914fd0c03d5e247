"""An id in an admin URL that is no row's id, or no number at all, answers 404 or the
admin's "does not exist" redirect (403 where the page is not allowed anyway), never a
500: the run's steer view, and every page of every admin of the three apps."""
from __future__ import annotations

import pytest
from django.contrib import admin
from django.urls import NoReverseMatch, reverse

import tests.pipes
from leases.pipelines.models import Run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_queue_settings")]

BAD_IDS = ["abc", "²", "1.5", "-1", "9" * 20, "9" * 5000, "%00"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_steering_a_run_that_cannot_exist_is_404(admin_client, bad):
    tests.pipes.three.start()
    response = admin_client.post(reverse("admin:leases_pipelines_run_steer", args=[bad]), {"steer": "cancel"})
    assert response.status_code == 404
    assert Run.objects.get().status == Run.RUNNING


def test_steering_a_run_gone_is_404(admin_client):
    run = tests.pipes.three.start()
    url = reverse("admin:leases_pipelines_run_steer", args=[run.pk + 1])
    assert admin_client.post(url, {"steer": "cancel"}).status_code == 404


def pages() -> list[str]:
    """The object pages of every admin of the three apps, by URL name."""
    found = []
    for model in admin.site._registry:
        if model._meta.app_label.startswith("leases"):
            base = f"admin:{model._meta.app_label}_{model._meta.model_name}"
            found += [f"{base}_{view}" for view in ("change", "history", "delete", "steer")]
    return found


@pytest.mark.parametrize("name", pages())
def test_no_admin_page_answers_500_for_an_id_that_cannot_exist(admin_client, name):
    for bad in BAD_IDS:
        try:
            url = reverse(name, args=[bad])
        except NoReverseMatch:
            return  # this admin has no such page
        response = admin_client.post(url) if name.endswith("_steer") else admin_client.get(url)
        assert response.status_code in (302, 403, 404), (bad, response.status_code)  # 403: no delete here
