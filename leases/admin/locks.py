"""Admin of named locks: who holds them and for how long, by the database clock;
breaking one goes through the engine."""
from __future__ import annotations

import math

from django.contrib import admin, messages
from django.utils.html import format_html

from leases.locks import break_lock
from leases.models import EPOCH, Lock, Resource
from leases.ops.adminkit import EMPTY, OnDatabase, PerRequest, compact_time, nowrap, request_now

from .resources import STATE_COLOURS


class LockLive(PerRequest):
    """The lock columns."""

    def _held(self, obj: Lock) -> bool:
        return obj.held_at(request_now(self.request))

    @admin.display(description="state")
    def state(self, obj: Lock) -> str:
        state = "held" if self._held(obj) else "free"
        colour = STATE_COLOURS[Resource.HELD if state == "held" else Resource.FREE]
        return format_html('<span style="white-space: nowrap"><span style="color: {}">●</span> {}</span>',
                           colour, state)

    @admin.display(description="owner", ordering="holder")
    def owner(self, obj: Lock) -> str:
        return nowrap(obj.holder) if self._held(obj) else EMPTY

    @admin.display(description="expires in (s)", ordering="expires_at")
    def expires_in(self, obj: Lock) -> int | str:
        if not self._held(obj):
            return EMPTY
        return math.floor((obj.expires_at - request_now(self.request)).total_seconds())


@admin.register(Lock)
class LockAdmin(OnDatabase, admin.ModelAdmin):
    """Named locks: who holds them and for how long; breaking one goes through the engine."""

    search_fields = ("name", "holder")
    actions = ["break_selected"]
    fields = readonly_fields = ("name", "holder", "token", "expires", "acquired")

    def get_queryset(self, request):
        return super().get_queryset(request).using(self.using)

    def get_list_display(self, request):
        live = LockLive.of(request)
        return ("name", live.state, live.owner, live.expires_in, "token", "acquired")

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Lock) -> str | None:
        return compact_time(obj.acquired_at)

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: Lock) -> str | None:
        return None if obj.expires_at == EPOCH else compact_time(obj.expires_at)

    def has_add_permission(self, request) -> bool:
        return False  # locks are made by taking them

    @admin.action(description="Break selected locks (whoever holds them)", permissions=["change"])
    def break_selected(self, request, queryset):
        locks = list(queryset)
        broken = 0
        for lock in locks:
            if break_lock(lock.name, using=self.using):
                broken += 1
                self.log_change(request, lock, f"Broken from the admin (held by {lock.holder or 'nobody'}).")
        text = f"Broke {broken} of {len(locks)} selected lock{'s' if len(locks) != 1 else ''}."
        if broken < len(locks):
            text += f" {len(locks) - broken} not held."
        self.message_user(request, text, messages.SUCCESS if broken else messages.WARNING)
