"""The server's clock is read by each statement, never frozen at a transaction's start
(PostgreSQL's now() is: a long transaction would see a lease that expired as held, and a
lease it takes as longer than it is)."""
from __future__ import annotations

import time

import pytest
from django.db import transaction

from leases import NoResourceAvailable, Pool
from leases.clock import db_now

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_long_transaction_sees_a_lease_expire():
    pool = Pool("clock")
    pool.add("only")
    pool.acquire(ttl=0.5)  # held, never released: it frees itself
    with transaction.atomic():
        began = db_now()  # the transaction is under way
        with pytest.raises(NoResourceAvailable):
            pool.acquire(ttl=5)
        time.sleep(0.8)
        assert (db_now() - began).total_seconds() >= 0.8  # the clock moves inside it
        lease = pool.acquire(ttl=5)  # free by the clock of this statement
    assert lease.name == "only" and lease.remaining() > 3
