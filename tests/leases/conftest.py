"""Fixtures shared by the lease tests."""
from __future__ import annotations

import pytest

from leases import ResourceThread


@pytest.fixture
def resource_threads():
    """make(cls=ResourceThread, **options): a holder thread, terminated when the test ends
    (whatever it asserted), so no heartbeat outlives its test."""
    made: list[ResourceThread] = []

    def make(cls: type[ResourceThread] = ResourceThread, **options) -> ResourceThread:
        thread = cls(**options)
        made.append(thread)
        return thread

    yield make
    for thread in made:
        thread.terminate()
