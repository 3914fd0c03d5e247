"""A `leases_worker` on PostgreSQL starts a pushed job at once, not at its next poll: with
`--poll 5` every pickup below still takes well under a second. The fault proxy's cut and
refusal drop its listen connection: it says so once, polls meanwhile, and listens again."""
from __future__ import annotations

import random
import time

import pytest
from django.db import connection

import tests.jobs  # noqa: F401 - registers noop
from leases.tasks import push
from tests.conftest import wait_for
from tests.helpers import pickup_seconds

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's"),
]

LISTENING = "listening for pushes (LISTEN"


def pickups(count: int) -> list[float]:
    """Push `count` jobs one by one at random moments; how long each waited."""
    seconds = []
    for n in range(count):
        time.sleep(random.uniform(0.1, 0.6))
        seconds.append(pickup_seconds(push("noop", {"n": n}).pk))
    return seconds


def test_a_push_wakes_the_worker_at_once(workers):
    proc = workers.start("--queue", "default", "--poll", "5")
    wait_for(lambda: LISTENING in workers.stderr(proc), 20, "the worker to listen")
    time.sleep(1)  # past the polls it made on starting
    waits = pickups(5)
    assert max(waits) < 0.5, waits  # polls every 5 s would average 2.5 s


def test_a_worker_told_not_to_listen_polls(workers):
    proc = workers.start("--queue", "default", "--poll", "0.2", "--no-listen")
    wait_for(lambda: "started" in workers.stderr(proc), 20, "the worker to start")
    assert pickup_seconds(push("noop", {"n": 1}).pk) < 5
    assert LISTENING not in workers.stderr(proc)
