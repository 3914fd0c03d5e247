"""Named SQL locks: ``lock(...)`` as a context manager, ``keep_alive``, ``Locked`` and ``@synchronized``.

Run it from the checkout::

    python -m project.examples.locks

With DATABASE_URL unset it works on db.sqlite3 in the checkout (set DATABASE_URL to use
another database); it applies the migrations first, uses only locks named
"example-lock:...", and deletes their rows at the end, so it can run again and again.
LEASES_LOG_LEVEL=INFO shows the library's own log lines as well.
"""
from __future__ import annotations

import os
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("LEASES_LOG_LEVEL", "WARNING")
django.setup()  # before importing anything that touches the app's models

from django.core.management import call_command  # noqa: E402

from leases import LeaseLost, Locked, lock, synchronized  # noqa: E402
from leases.locks import acquire_lock  # noqa: E402
from leases.models import Lock  # noqa: E402

PREFIX = "example-lock:"


def basic() -> None:
    """One holder at a time; a second taker gets Locked, which says who holds it."""
    with lock(PREFIX + "report", ttl=10, holder="nightly-report") as held:
        # The token grows with every holder of this lock: a fencing token for other systems.
        print(f"nightly-report holds {held.name} (token {held.token}, {held.remaining():.1f}s left)")
        try:
            # wait=0.2: try for a fifth of a second, then give up.
            with lock(PREFIX + "report", ttl=10, wait=0.2, holder="adhoc-report"):
                print("adhoc-report got it too (this never happens)")
        except Locked as exc:
            print(f"adhoc-report: {exc}")
            # The holder string is the holder name plus a random part unique to that acquisition.
            print(f"  exc.holder={exc.holder!r}, exc.expires_in={exc.expires_in:.1f}s")
    print("nightly-report left its block: the lock is free again")


def keep_alive() -> None:
    """A block may outlast its ttl when a heartbeat renews the lock, and only then."""
    name = PREFIX + "long-job"
    with lock(name, ttl=0.6, keep_alive=True, holder="long-job"):
        time.sleep(1.0)  # longer than the ttl; the heartbeat renews every ttl/3 seconds
        try:
            acquire_lock(name, holder="rival")
        except Locked:
            print("keep_alive=True: after 1.0s with ttl=0.6s the lock is still held, a rival is refused")

    # Without keep_alive the lock expires in the middle of the block and someone else may
    # take it; the block notices only when it ends, and says so with LeaseLost.
    rival = None
    try:
        with lock(name, ttl=0.6, holder="forgetful"):
            time.sleep(1.0)
            rival = acquire_lock(name, holder="rival")
            print(f"keep_alive=False: after 1.0s with ttl=0.6s a rival took it (token {rival.token})")
    except LeaseLost as exc:
        print(f"  and leaving the block raised LeaseLost: {exc}")
    finally:
        if rival is not None:
            rival.release()


@synchronized(PREFIX + "invoice:", arg="invoice_id", ttl=30)
def send_invoice(invoice_id: int) -> str:
    """Runs under the lock "example-lock:invoice:<invoice_id>": one sender per invoice."""
    return f"invoice {invoice_id} sent"


def decorated() -> None:
    print(f"@synchronized: {send_invoice(7)}")
    with lock(PREFIX + "invoice:7", ttl=10, holder="month-end-batch"):
        try:
            send_invoice(invoice_id=7)
        except Locked as exc:
            print(f"@synchronized: invoice 7 is busy: {exc}")
        # Another invoice is another lock, so it goes ahead.
        print(f"@synchronized: {send_invoice(8)} meanwhile")


def main() -> None:
    call_command("migrate", verbosity=0)
    try:
        basic()
        keep_alive()
        decorated()
    finally:
        # A lock's row stays after release (so its token keeps growing); an example tidies up.
        Lock.objects.filter(name__startswith=PREFIX).delete()


if __name__ == "__main__":
    main()
