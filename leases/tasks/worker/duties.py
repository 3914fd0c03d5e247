"""What a worker's loop does on timers besides claiming and writing outcomes: its heartbeat,
recovery of lapsed jobs, trims and the scheduler's passes, each a `Duty`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Duty:
    """Something the loop does every `every` seconds, due first at `due`."""

    call: Callable[[], object]
    every: float
    due: float = 0.0
    #: Whether it goes on while the worker stops (the heartbeat must; claiming more must not).
    while_stopping: bool = True
    #: Whether the call returns the seconds until it is due again (it keeps its own pace).
    paced: bool = False

    def run_if_due(self, now: float, stopping: bool) -> None:
        if self.applies(stopping) and now >= self.due:
            after = self.call()
            # Not moved when the call raised: tried again next turn.
            self.due = now + (after if self.paced else self.every)

    def applies(self, stopping: bool) -> bool:
        return self.while_stopping or not stopping
