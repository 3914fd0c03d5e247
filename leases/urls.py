"""URLs of the metrics endpoint and the dashboard: ``path("leases/", include("leases.urls"))``."""
from django.urls import path

from .ops import dashboard, htmx, metrics

app_name = "leases"

urlpatterns = [
    path("metrics", metrics.metrics, name="metrics"),
    path("metrics/", metrics.metrics),  # scrape configs name either
    path("dashboard/", dashboard.dashboard, name="dashboard"),
    path("dashboard/htmx.js", htmx.script, name="htmx"),
]
