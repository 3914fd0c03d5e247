"""htmx, the script that refreshes the dashboard's panels, as django-htmx bundles it.

django-htmx ships htmx as a static file of its app, which staticfiles finds only when
"django_htmx" is in INSTALLED_APPS. The dashboard serves that same file from the
installed package at a URL of its own instead, so it works in a project that lists
neither the app nor its middleware, with no collectstatic. The URL names django-htmx's
version, so a browser keeps the script for a year and fetches it again after an upgrade.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import metadata, resources

from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_GET

#: The script in the django_htmx package: htmx 2, minified.
SCRIPT = "static/django_htmx/htmx-2.min.js"


@lru_cache(maxsize=1)
def _script() -> bytes:
    return (resources.files("django_htmx") / SCRIPT).read_bytes()


@lru_cache(maxsize=1)
def _version() -> str:
    return metadata.version("django-htmx")


def script_url() -> str:
    """Where the dashboard loads htmx from, versioned."""
    return f"{reverse('leases:htmx')}?v={_version()}"


@require_GET
def script(request: HttpRequest) -> HttpResponse:
    """The script, to anyone (it is public code), cacheable for a year."""
    response = HttpResponse(_script(), content_type="text/javascript; charset=utf-8")
    response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response
