"""The dispatcher: a pool of scored task ids handed out to workers' buckets, lowest score first.

Two crawler workers take turns here: they fill their buckets (``assign_tasks``), report
what they finished (``tasks_done``), and one of them goes silent, so its bucket goes back
to the pool (``reclaim``); ``stats`` shows the counts along the way. In a real fleet each
worker is its own process, on any host, making the same calls; they are sequential here
so that the output reads in order.

Run it from the checkout::

    python -m project.examples.dispatcher

With DATABASE_URL unset it works on db.sqlite3 in the checkout (set DATABASE_URL to use
another database); it applies the migrations first, uses only the dispatcher
"example-crawl", and deletes its rows at the end, so it can run again and again.
"""
from __future__ import annotations

import os
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
os.environ.setdefault("LEASES_LOG_LEVEL", "WARNING")
django.setup()  # before importing anything that touches the app's models

from django.core.management import call_command  # noqa: E402

from leases.models import Lock  # noqa: E402
from leases.tasks import Dispatcher  # noqa: E402
from leases.tasks.models import DispatchWorker, PoolTask, TaskPool  # noqa: E402

NAME = "example-crawl"
A, B = "example-worker-a", "example-worker-b"

# Task id -> score; the lowest scores are handed out first (here: hours since the last
# crawl, negated, so the stalest page goes first).
PAGES = {
    "example.com/": -30.0,
    "example.com/news": -48.0,
    "example.com/about": -2.0,
    "example.com/jobs": -12.0,
    "example.com/blog": -24.0,
    "example.com/blog/1": -6.0,
    "example.com/blog/2": -5.0,
    "example.com/contact": -1.0,
}


def show(d: Dispatcher) -> None:
    s = d.stats()
    buckets = ", ".join(f"{worker}: {info['bucket']}" for worker, info in sorted(s["workers"].items()))
    print(f"  stats: pool {s['pool']}, assigned {s['assigned']}, done {s['done']}; buckets {buckets or '-'}")


def main() -> None:
    call_command("migrate", verbosity=0)
    d = Dispatcher(NAME, stale_after=600)
    try:
        print(f"pool loaded: {d.recreate_task_pool(PAGES)} tasks")

        a = d.assign_tasks(3, A)
        b = d.assign_tasks(3, B)
        print(f"{A} got {a}")
        print(f"{B} got {b}")
        # Asking again tops the bucket up to the limit: nothing new while it is full.
        assert d.assign_tasks(3, A) == a
        show(d)

        print(f"{A} finished {d.tasks_done(A, a[:2])} tasks, asks for more: {d.assign_tasks(3, A)}")
        show(d)

        # B goes silent (crashed, say). A worker unseen for stale_after seconds loses its
        # bucket: assign_tasks reclaims on its own now and then; an operator may call
        # reclaim() too, here with a tiny stale_after so the example need not wait 10 min.
        time.sleep(1.0)
        d.assign_tasks(3, A)  # A is alive: every assign_tasks marks its worker as seen
        print(f"reclaim: {d.reclaim(stale_after=0.5)} tasks of silent workers back in the pool")
        show(d)
        # A worker that comes back checks its bucket before going on with it: False means
        # some of it went elsewhere, so it drops that work and asks again.
        print(f"{B} is back: check_tasks says its old bucket is still its own: {d.check_tasks(B, b)}")
        print(f"{B} got {d.assign_tasks(3, B)}")

        # Without a list, tasks_done takes the whole bucket as done.
        print(f"{A} finished {d.tasks_done(A)} tasks, {B} finished {d.tasks_done(B)}")
        show(d)
    finally:
        PoolTask.objects.filter(dispatcher=NAME).delete()
        DispatchWorker.objects.filter(dispatcher=NAME).delete()
        TaskPool.objects.filter(name=NAME).delete()
        # Rebuilds run one at a time under this lock; its row stays after release.
        Lock.objects.filter(name=f"dispatch-rebuild:{NAME}").delete()


if __name__ == "__main__":
    main()
