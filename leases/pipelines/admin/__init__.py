"""Admin of pipeline runs: the list and its steering (`runs`), a run's page (`page`) and
its timeline (`timeline`)."""
from django.apps import apps

# Without the job queue there is nothing to show, and the system check leases.E015 says
# what to add; importing the parts would import leases.tasks' models, whose RuntimeError
# would hide that check.
if apps.is_installed("leases.tasks"):
    from . import runs  # noqa: F401 - registers the admin
