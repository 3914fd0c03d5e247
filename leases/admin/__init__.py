"""Admin of the base app: resources, what each target says of them, and named locks, on the engine's database or, through
`site_for`, on another (``leases.admin.site_for("eu")`` is the documented path)."""
from django.apps import apps

from leases.ops.adminkit import site_for

# A project with leases.tasks but without this app gets the system check leases.E014
# saying what to add; importing the parts would import leases.models, whose RuntimeError
# (in a URLconf that imports this module for site_for) would hide that check.
if apps.is_installed("leases"):
    from . import locks, resource_targets, resources  # noqa: F401 - registers the admins

__all__ = ["site_for"]
