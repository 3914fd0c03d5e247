"""Durable handlers for the fault tests' worker processes (`--import tests.faults.durable_handlers`).

Each job steps, sleeps, waits twice for the event "go" and once, in vain, for the event
"late" (its timeout gives a default), steps again: nine places. Each run
of a step's body appends "ran N NAME CLAIMS TOKEN" to the file its payload names, and
each value the handler gets back from a step "saw N NAME CLAIMS TOKEN", the token being
new at each run of the body. So a test tells a body that ran twice from a step stored
twice, and checks that every run of the handler saw the one result stored, without
trusting the database it checks. The async twin runs the same places on the worker's loop.
"""
from __future__ import annotations

import uuid
from typing import Any

from leases.tasks import handler

#: The places of a job, in order: steps, sleeps, the two waits for "go" and one that times out.
PLACES = ("fetch", "sleep", "parse", "wait:go", "store", "sleep", "wait:go", "wait:late", "report")
#: What the wait for "late", never sent, returns when its timeout comes.
LATE = {"late": "none came"}
#: The places whose result a step's body made (the rest are sleeps and waits).
STEPS = ("fetch", "parse", "store", "report")


def _log(payload: dict, line: str) -> None:
    with open(payload["log"], "a") as out:
        out.write(line + "\n")


def _body(payload: dict, name: str, claims: int) -> str:
    token = uuid.uuid4().hex[:16]
    _log(payload, f"ran {payload['n']} {name} {claims} {token}")
    return token


def _saw(payload: dict, name: str, claims: int, token: str) -> str:
    _log(payload, f"saw {payload['n']} {name} {claims} {token}")
    return token


@handler("durable.flow", queue="default", max_attempts=10, backoff=0.0)
def flow(payload: dict, ctx: Any) -> dict:
    tokens, events = {}, []
    for name in PLACES:
        if name == "sleep":
            ctx.sleep(payload["sleep"])
        elif name == "wait:go":
            events.append(ctx.wait_for("go"))  # no timeout: a lost wake-up never ends
        elif name == "wait:late":
            events.append(ctx.wait_for("late", timeout=0.3, default=LATE))
        else:
            token = ctx.step(name, _body, payload, name, ctx.claims)
            tokens[name] = _saw(payload, name, ctx.claims, token)
    return {"steps": tokens, "events": events}


@handler("durable.aflow", queue="default", max_attempts=10, backoff=0.0)
async def aflow(payload: dict, ctx: Any) -> dict:
    tokens, events = {}, []
    for name in PLACES:
        if name == "sleep":
            await ctx.asleep(payload["sleep"])
        elif name == "wait:go":
            events.append(await ctx.await_for("go"))
        elif name == "wait:late":
            events.append(await ctx.await_for("late", timeout=0.3, default=LATE))
        else:
            token = await ctx.astep(name, _body, payload, name, ctx.claims)
            tokens[name] = _saw(payload, name, ctx.claims, token)
    return {"steps": tokens, "events": events}
