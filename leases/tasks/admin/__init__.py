"""Admin of the job queue and the dispatcher, one module per concept."""
from django.apps import apps

# Without the base app there is nothing to show, and the system check leases.E014 says
# what to add; importing the parts would import leases.models, whose RuntimeError would
# hide that check.
if apps.is_installed("leases"):
    from . import dispatch, jobs, limits, queues, schedules  # noqa: F401 - registers the admins
