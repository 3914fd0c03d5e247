"""A holding the spider gives up (a rotation, a ban, a quarantine), and the verdicts that
reach it while the spider's requests run side by side."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...lease import Lease

#: A holding: the slot's row and its token (a new acquisition of the row has a new one).
Key = tuple[int, int]


def key_of(lease: Lease) -> Key:
    return (lease.id, lease.token)


def where(lease: Lease) -> str:
    return f"{lease.pool}/{lease.name} (token {lease.token})"


class Handover:
    """One holding being given up, and how: rotated (released to rest `cooldown`), banned
    for the spider's target (`ban`, the reason: written, then released), or quarantined
    (`quarantine`: seconds and reason). The first two wait for the requests still out on
    the proxy before it is released; a quarantine gives it to nobody, so it does not.

    With requests side by side, more verdicts on the holding arrive while it is being
    given up. Each only makes it stricter (a rotation becomes a ban, anything becomes a
    quarantine; the first reason stays), and the task that gives it up reads them at fixed
    points and passes the holder its own arguments, so none is lost or passed twice. Once
    the holder has it (`commit()`), later verdicts find the holding gone.
    """

    def __init__(self, lease: Lease) -> None:
        self.lease, self.key = lease, key_of(lease)
        self.cooldown: float | None = None
        self.ban: str | None = None
        self.quarantine: tuple[float, str] | None = None
        self.task: asyncio.Future | None = None
        self._committed = False

    def add(self, cooldown: float | None = None, ban: str | None = None,
            quarantine: tuple[float, str] | None = None) -> None:
        """A verdict on the holding (see the class's docstring)."""
        if cooldown is not None:
            self.cooldown = cooldown if self.cooldown is None else max(cooldown, self.cooldown)
        if ban is not None and self.ban is None:
            self.ban = ban
        if quarantine is not None and self.quarantine is None:
            self.quarantine = quarantine

    def pending(self) -> bool:
        return self.task is not None and not self.task.done()

    def open(self) -> bool:
        """Whether a verdict can still change how the holding is given up."""
        return self.pending() and not self._committed

    def commit(self) -> None:
        self._committed = True
