"""What the job queue's admins share: admins of rows only the engine writes, and times
told relative to the database clock."""
from __future__ import annotations

from datetime import datetime

from django.contrib import admin
from django.utils.html import format_html

from leases.management.text import ago
from leases.ops.adminkit import EMPTY, OnDatabase, local_time


class ReadOnly(OnDatabase, admin.ModelAdmin):
    """Rows of the engine's database (settings.LEASES_DATABASE), to look at only."""

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


def relative(moment: datetime | None, now: datetime) -> str:
    """'in 3s' or '12s ago' by the database clock; the exact time on hover."""
    if moment is None:
        return EMPTY
    return format_html('<span style="white-space: nowrap" title="{}">{}</span>',
                       local_time(moment), ago(moment, now))
