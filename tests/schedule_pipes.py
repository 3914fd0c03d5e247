"""A pipeline whose work is all on queue "crawl", for the tests of scheduled pipelines
(workers load it with ``--import tests.schedule_pipes``): as docs/resources.md has a
crawl fleet, no worker serves "default". Each task appends "stage run-id pid" to the
file its run's context names."""
from __future__ import annotations

import os

from leases.pipelines import Pipeline, Stage
from leases.tasks import handler


def _line(payload: dict, stage: str) -> None:
    path = (payload.get("context") or {}).get("log")
    if path:
        with open(path, "a") as out:
            out.write(f"{stage} {payload.get('run')} {os.getpid()}\n")


@handler("sp.list", queue="crawl", backoff=0.0)
def list_pages(payload):
    _line(payload, "list")
    return ["a", "b"]


@handler("sp.fetch", queue="crawl", backoff=0.0)
def fetch(payload):
    _line(payload, "fetch")


crawl = Pipeline("crawl-fleet", [
    Stage("list", ["sp.list"]),
    Stage("fetch", ["sp.fetch"], for_each="sp.list"),
])
