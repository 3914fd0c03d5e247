"""Where the dashboard drills down to: the admin's list of a model's rows, filtered.

The admin site that shows LEASES_DATABASE is the project's own (`admin`); another
database's is the site `leases.admin.site_for(alias)` made, named ``leases_<alias>``,
wherever the project mounted it. A database no mounted site shows gets no links. A link
never filters by a field its admin masks (`adminkit.Masking`): a viewer's click would be
refused, and a count by a masked value would tell it.
"""
from __future__ import annotations

from urllib.parse import urlencode

from django.apps import apps
from django.contrib import admin
from django.urls import NoReverseMatch, reverse

from leases import db


def changelist(model: str, using: str, **filters: object) -> str:
    """The admin's list of `model` ("app_label.model_name") on database `using`, with
    `filters` as its query string; "" where no mounted admin site lists it. ValueError for
    a filter on a masked field."""
    site = "admin" if using == db.alias() else f"leases_{using}"
    app_label, model_name = model.split(".")
    model_admin = admin.site._registry.get(apps.get_model(app_label, model_name))
    masked = [key for key in filters if model_admin is not None and hasattr(model_admin, "reads_masked")
              and model_admin.reads_masked(None, key)]
    if masked:
        raise ValueError(f"a link to the {model} list filters by {', '.join(masked)}, which its admin masks")
    try:
        url = reverse(f"{site}:{app_label}_{model_name}_changelist")
    except NoReverseMatch:
        return ""
    return f"{url}?{urlencode(filters)}" if filters else url
