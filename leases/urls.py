"""URLs of the metrics endpoint and the dashboard: ``path("leases/", include("leases.urls"))``."""
from django.urls import path

from .ops import dashboard, metrics

app_name = "leases"

urlpatterns = [
    path("metrics", metrics.metrics, name="metrics"),
    path("dashboard/", dashboard.dashboard, name="dashboard"),
]
