"""The worker's handler threads start when a job needs one, up to its concurrency, so a
worker of async handlers keeps few; a given-up thread's place goes to a new one."""
from __future__ import annotations

import queue as stdqueue
import threading

from leases.tasks.jobs.claim import ClaimedJob
from leases.tasks.registry import Handler
from leases.tasks.worker.threads import Threads
from tests.conftest import wait_for

GATES: dict[int, threading.Event] = {}


def blocking(payload: dict) -> int:
    """Runs until the test opens its job's gate."""
    GATES[payload["n"]].wait(timeout=30)
    return payload["n"]


SPEC = Handler(name="threads.block", func=blocking, queue="default", max_attempts=1, backoff=0.0)


def job(n: int) -> ClaimedJob:
    GATES[n] = threading.Event()
    return ClaimedJob(id=n, queue="default", name=SPEC.name, backend="", payload={"n": n}, attempt=1,
                      max_attempts=1, priority=0, key="", handler=SPEC)


def handler_threads() -> int:
    return sum(1 for thread in threading.enumerate() if thread.name == "leases-job" and thread.is_alive())


def test_threads_start_as_jobs_need_them_and_a_given_up_one_is_replaced():
    before = handler_threads()
    done: stdqueue.Queue = stdqueue.Queue()
    threads = Threads(8, done)
    try:
        assert handler_threads() == before  # none until a job comes
        first, second = job(1), job(2)
        threads.submit(first)
        threads.submit(second)
        wait_for(lambda: handler_threads() == before + 2, 5, "a thread for each running job")
        GATES[1].set()
        assert done.get(timeout=10).job is first
        third = job(3)
        threads.submit(third)  # the first one's thread is free: no new one
        assert handler_threads() == before + 2
        threads.abandon(second)  # stuck: its thread runs on, no longer counted
        fourth = job(4)
        threads.submit(fourth)
        wait_for(lambda: handler_threads() == before + 3, 5, "a new thread in the stuck one's place")
        GATES[2].set()  # the given-up thread ends once its handler returns
        wait_for(lambda: handler_threads() == before + 2, 5, "the given-up thread gone")
        GATES[3].set()
        GATES[4].set()
        assert {done.get(timeout=10).job.id for _ in range(3)} == {2, 3, 4}
    finally:
        for gate in GATES.values():
            gate.set()
        threads.stop()
    wait_for(lambda: handler_threads() == before, 5, "every thread ended at stop")
