"""Admin of the base app: resources and named locks, on the engine's database or, through
`site_for`, on another (``leases.admin.site_for("eu")`` is the documented path)."""
from leases.ops.adminkit import site_for

from . import locks, resources  # noqa: F401 - registers the admins

__all__ = ["site_for"]
