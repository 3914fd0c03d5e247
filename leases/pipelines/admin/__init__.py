"""Admin of pipeline runs: the list and its steering (`runs`), a run's page (`page`) and
its timeline (`timeline`)."""
from django.apps import apps

# Without the job queue (or the base app under it) there is nothing to show, and the
# system checks leases.E015 and E014 say what to add; importing the parts would import
# their models, whose RuntimeError would hide those checks.
if apps.is_installed("leases.tasks") and apps.is_installed("leases"):
    from . import runs  # noqa: F401 - registers the admin
