from django.conf import settings
from django.contrib import admin
from django.urls import include, path

from leases.admin import site_for

urlpatterns = [
    # Each other database gets an admin site of its own: /admin/second/ shows its pools and queues.
    *[path(f"admin/{alias}/", site_for(alias).urls) for alias in settings.DATABASES if alias != "default"],
    path("admin/", admin.site.urls),
    path("leases/", include("leases.urls")),
]
