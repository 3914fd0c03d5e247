"""Handlers and pipelines the pipeline tests run; workers load them with
``--import tests.pipes``. Each task appends "stage task item pid" to the file named in the
run's context, so a test can see what ran where without trusting the database."""
from __future__ import annotations

import os
import time

import tests.jobs  # noqa: F401 - registers the limit.* handlers the limited pipelines run
from leases.pipelines import Pipeline, Stage, cancelled
from leases.tasks import Fail, Needs, handler


def drain(concurrency: int = 4) -> None:
    """Run the queue's jobs in this process until none is left."""
    from leases.tasks.worker import JobWorker

    JobWorker(queues=["default"], concurrency=concurrency, burst=True, poll=0.01).run()


def stages(run) -> dict:
    """A run's stages by name."""
    return {stage.name: stage for stage in run.stages.all()}


def _record(payload: dict, name: str) -> None:
    path = payload["context"].get("log")
    if path:
        with open(path, "a") as out:
            out.write(f"{payload['stage']} {name} {payload.get('item')} {os.getpid()}\n")


def _nap(payload: dict) -> None:
    seconds = payload["context"].get("nap", 0)
    if seconds:
        time.sleep(seconds)


@handler("p.discover", queue="default", backoff=0.0)
def discover(payload):
    _record(payload, "discover")
    return list(range(payload["context"].get("items", 3)))


@handler("p.fetch", queue="default", backoff=0.0)
def fetch(payload):
    _record(payload, "fetch")
    _nap(payload)
    return payload["item"] * 10


@handler("p.thumbs", queue="default", backoff=0.0)
def thumbs(payload):
    _record(payload, "thumbs")
    _nap(payload)
    return "thumbs"


@handler("p.transcode", queue="default", backoff=0.0)
def transcode(payload):
    _record(payload, "transcode")
    _nap(payload)
    return "transcode"


@handler("p.index", queue="default", backoff=0.0)
def index(payload):
    _record(payload, "index")
    return {"fetched": payload["results"]["p.fetch"], "found": payload["results"]["p.discover"]}


@handler("p.fail", queue="default", max_attempts=2, backoff=0.0)
def fail(payload):
    _record(payload, "fail")
    raise RuntimeError("always fails")


@handler("p.refuse", queue="default", backoff=0.0)
def refuse(payload):
    _record(payload, "refuse")
    raise Fail("refused")


@handler("p.items", queue="default", backoff=0.0)
def items(payload):
    """The context's list, for a for_each."""
    return payload["context"]["items"]


@handler("p.dict", queue="default", backoff=0.0)
def not_a_list(payload):
    return {"not": "a list"}


@handler("p.watch", queue="default", backoff=0.0)
def watch(payload):
    """Runs until its run is cancelled (or 20 s), then says which."""
    _record(payload, "watch")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if cancelled(payload):
            return "saw cancel"
        time.sleep(0.05)
    return "timed out"


def _step(name: str):
    @handler(f"p.{name}", queue="default", backoff=0.0)
    def step(payload):
        _record(payload, name)
        _nap(payload)
        return name

    return step


for _name in ("a1", "a2", "a3", "a4", "a5", "b1", "b2", "b3", "b4", "b5", "c1", "c2", "c3", "c4", "c5", "s1", "s2"):
    _step(_name)


crawl = Pipeline("crawl-site", [
    Stage("discover", ["p.discover"]),
    Stage("fetch", ["p.fetch"], for_each="p.discover", max_parallel=20),
    Stage("media", ["p.thumbs", "p.transcode"], parallel=True, requires=["discover"]),
    Stage("index", ["p.index"], requires=["fetch", "media"]),
])

three = Pipeline("three-by-five", [
    Stage("a", ["p.a1", "p.a2", "p.a3", "p.a4", "p.a5"], parallel=True),
    Stage("b", ["p.b1", "p.b2", "p.b3", "p.b4", "p.b5"], parallel=True),
    Stage("c", ["p.c1", "p.c2", "p.c3", "p.c4", "p.c5"], parallel=True),
])

limited_fan = Pipeline("limited-fan", [
    Stage("list", ["p.items"]),
    Stage("each", ["limit.one"], for_each="p.items", max_parallel=6),
])

rated_fan = Pipeline("rated-fan", [
    Stage("list", ["p.items"]),
    Stage("each", ["limit.rated"], for_each="p.items", max_parallel=6),
])

@handler("p.leased", queue="default", backoff=0.0, lease=Needs("pipepool", target=lambda p: p["item"]["site"]))
def leased(payload, ctx):
    """A pipeline task that holds a resource while it runs: returns its name and token."""
    return [ctx.lease.name, ctx.lease.token]


leased_fan = Pipeline("leased-fan", [
    Stage("list", ["p.items"]),
    Stage("each", ["p.leased"], for_each="p.items", max_parallel=6),
])

sites_fan = Pipeline("sites-fan", [
    Stage("list", ["p.items"]),
    Stage("each", ["limit.by_site"], for_each="p.items", max_parallel=6),
])
