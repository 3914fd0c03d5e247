"""Durable handlers' rows: a job's steps and the events sent to it.

A step's result is written in a short transaction of its own, fenced by the job's claim
(`id`, `claims`, running), so an attempt that was recovered and run again elsewhere
cannot write it. A sleep or a wait is a step begun (with its end, by the database clock)
and then done. An event is a row kept until a wait of its name takes it, so one sent
before the wait is not lost, and each wait takes exactly one; an event that arrives while
its job is suspended waiting for it wakes the job. The handler's side is
`leases.tasks.context`; a suspension is written with the attempt's outcome (`outcomes`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from leases import db
from leases.encoding import load_json
from leases.sql import in_list
from leases.validation import check_name

from .. import sql
from ..models import STEP_NAME_LENGTH, Job
from .payload import dump_payload
from .push import announce

#: What `Job.waiting_for` holds for a suspended job: a sleep, or a wait for an event.
SLEEPING = "sleep"
EVENT = "event:"
#: A wait without a timeout ends this far away (the job's run time must be a moment).
FOREVER = 10 * 365 * 86400.0
#: The steps and events of one job operators see (the newest): a job of thousands of
#: steps costs them one short read.
SHOWN = 50


@dataclass(frozen=True)
class Stored:
    """A step as the database holds it: `over` tells whether a begun sleep's or wait's
    end has come, by the database clock."""

    seq: int
    name: str
    result: Any
    done: bool
    until: datetime | None
    over: bool


class Superseded(Exception):
    """This attempt's claim is no longer the job's (it was recovered and runs elsewhere):
    it must write nothing more."""


#: Longest event and patch names: a wait's step is stored as "wait:<event>", a patch's
#: marker as "patch:<change>", within the step name's column.
EVENT_NAME_LENGTH = STEP_NAME_LENGTH - len("wait:")
PATCH_NAME_LENGTH = STEP_NAME_LENGTH - len("patch:")


def check_step_name(name: Any) -> str:
    return check_name(name, "step name", STEP_NAME_LENGTH)


def check_event_name(name: Any) -> str:
    return check_name(name, "event name", EVENT_NAME_LENGTH)


def load(job_id: int, using: str) -> dict[int, Stored]:
    """The job's steps by place."""

    def work(cursor: Any, resumed: bool) -> list[tuple]:
        cursor.execute(sql.steps(cursor.db).of_job, (job_id,))
        return cursor.fetchall()

    return {row[0]: Stored(row[0], row[1], load_json(row[2]) if isinstance(row[2], str) else row[2], bool(row[3]),
                           None if row[4] is None else db.to_datetime(row[4]), bool(row[5]))
            for row in db.run(work, using)}


def record(job: Any, seq: int, name: str, result: Any, using: str) -> Any:
    """Store a completed step's result (JSON, or ValueError in one line); returns it as
    stored. Superseded when the attempt's claim is gone. A lost reply is looked up: the
    step is written once."""
    text = dump_payload(result, f"the result of step {name!r}")

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.steps(cursor.db)
        if resumed:
            cursor.execute(st.until, (job.id, seq))  # written before the reply was lost?
            if cursor.fetchone() is not None:
                return 1
        cursor.execute(st.record, (job.id, seq, name, text, job.id, job.claims))
        return cursor.rowcount

    if db.run(work, using) != 1:
        raise Superseded(f"job #{job.id}'s claim {job.claims} is no longer current")
    return load_json(text)


def begin(job: Any, seq: int, name: str, using: str, seconds: float | None = None,
          at: datetime | None = None) -> datetime:
    """Begin a sleep or a wait ending `seconds` from now, or `at`; its end as stored."""

    def work(cursor: Any, resumed: bool) -> Any:
        st = sql.steps(cursor.db)
        cursor.execute(st.until, (job.id, seq))
        found = cursor.fetchone()
        if found is None:
            if at is not None:
                moment = db.dialect(cursor.db).stored_datetime(at)
                cursor.execute(st.begin_at, (job.id, seq, name, moment, job.id, job.claims))
            else:
                cursor.execute(st.begin, (job.id, seq, name, db.dialect(cursor.db).seconds(seconds),
                                          job.id, job.claims))
            if cursor.rowcount != 1:
                raise Superseded(f"job #{job.id}'s claim {job.claims} is no longer current")
            cursor.execute(st.until, (job.id, seq))
            found = cursor.fetchone()
        return found[0]

    return db.to_datetime(db.run(work, using))


def take_event(job: Any, seq: int, name: str, using: str) -> tuple[bool, Any]:
    """(whether an event of `name` was there, its data): the oldest one no wait took, taken
    by this wait (step `seq`, begun or not), in one transaction fenced by the claim. A wait
    done already (a lost reply) returns what it took."""

    def work(cursor: Any, resumed: bool) -> tuple[bool, Any]:
        st = sql.steps(cursor.db)
        with db.write_transaction(using):
            cursor.execute(st.step, (job.id, seq))
            step = cursor.fetchone()
            if step is not None and step[0]:  # taken already: by a try whose COMMIT's reply was lost
                stored = load_json(step[1]) if isinstance(step[1], str) else step[1]
                if isinstance(stored, dict) and "data" in stored:
                    return True, stored["data"]
            begun = step is not None
            cursor.execute(st.next_event, (job.id, name))
            found = cursor.fetchone()
            if found is None:
                return False, None
            event_id, data = found
            text = data if isinstance(data, str) or data is None else dump_payload(data)
            result = dump_payload({"data": load_json(text) if text is not None else None})
            if begun:
                cursor.execute(st.finish, (result, job.id, seq, job.id, job.claims))
            else:
                # under the wait's own name, as a wait begun first is (`wait_for` checks it on reruns)
                cursor.execute(st.record, (job.id, seq, f"wait:{name}", result, job.id, job.claims))
            if cursor.rowcount != 1:
                raise Superseded(f"job #{job.id}'s claim {job.claims} is no longer current")
            cursor.execute(st.take_event, (seq, event_id))
            return True, load_json(result)["data"]

    return db.run(work, using)


def time_out(job: Any, seq: int, using: str) -> None:
    """A begun wait whose end came: done, timed out."""

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.steps(cursor.db)
        cursor.execute(st.finish, ('{"timed_out": true}', job.id, seq, job.id, job.claims))
        if cursor.rowcount == 0 and resumed:  # written before the reply was lost?
            cursor.execute(st.step, (job.id, seq))
            step = cursor.fetchone()
            return 1 if step is not None and step[0] else 0
        return cursor.rowcount

    if db.run(work, using) != 1:
        raise Superseded(f"job #{job.id}'s claim {job.claims} is no longer current")


def suspend(cursor: Any, job: Any, until: datetime, event: str) -> bool:
    """Write a suspended attempt (its outcome), in the caller's transaction: the job waits,
    ready, until `until` or, with `event`, the event of that name, which may have come
    meanwhile (then it runs now). Whether the claim was still current."""
    st = sql.steps(cursor.db)
    when = db.dialect(cursor.db).stored_datetime(until)
    cursor.execute(st.suspend, (when, waits_for(event), job.id, job.claims))
    if cursor.rowcount != 1:
        return False
    if event:  # the job's row is locked now: an event sent since is seen, or wakes it
        cursor.execute(st.pending, (job.id, event))
        if cursor.fetchone() is not None:
            cursor.execute(st.run_now, (job.id,))
    return True


def waiting(waiting_for: str, until: datetime, now: datetime, moment: Callable[[datetime], str]) -> str:
    """What a suspended job waits for, as operators read it, `moment` writing its end."""
    if waiting_for == SLEEPING:
        return f"its sleep's end, {moment(until)}"
    event = f"the event {waiting_for.removeprefix(EVENT)!r}"
    if (until - now).total_seconds() > FOREVER / 2:
        return f"{event} (no timeout)"
    return f"{event}, or its timeout {moment(until)}"


def state(step: Any, now: datetime, moment: Callable[[datetime], str]) -> str:
    """A stored step as operators read it: done; or a begun sleep's or wait's end, 'until'
    while to come, 'ended' once past (a sleep is not written again once it is over)."""
    if step.done:
        return "done"
    if step.until is None:
        return "begun"
    return f"{'until' if step.until > now else 'ended'} {moment(step.until)}"


def waits_for(event: str) -> str:
    """What a suspended job's row says it waits for: SLEEPING, or EVENT + the event's name."""
    return f"{EVENT}{event}" if event else SLEEPING


def send_event(job: int | str | Job, name: str, data: Any = None, using: str | None = None) -> int:
    """Send the event `name` with its JSON `data` to a job (a Job, its id, or the key it was
    pushed with): kept until a wait of that name takes it, and waking the job if it waits
    for it now. Returns the job's id. ValueError (one line, nothing written) for a job that
    does not exist or has ended, a bad name or data that is not JSON. A lost reply is
    looked up: the event is stored once."""
    name = check_event_name(name)
    text = dump_payload(data, "the event's data")
    using = db.alias(using)
    tries: list[int] = []  # the event's id as each try inserted it

    def work(cursor: Any, resumed: bool) -> int:
        st = sql.steps(cursor.db)
        job_id = _job_id(cursor, job)
        with db.write_transaction(using):
            if resumed and tries:  # a try whose COMMIT's reply was lost may have stored it: sent once
                cursor.execute(st.sent + in_list(tries), tries)
                if cursor.fetchone() is not None:
                    return job_id
            cursor.execute(st.lock_job, (job_id,))
            found = cursor.fetchone()
            if found is None:
                raise ValueError(f"no job #{job_id}: the event {name!r} was not sent")
            if found[0] in Job.FINISHED:
                raise ValueError(f"job #{job_id} has ended ({dict(Job.STATUSES)[found[0]]}): the event {name!r}"
                                 " was not sent")
            cursor.execute(st.send, (job_id, name, text))
            tries.append(cursor.lastrowid)
            cursor.execute(st.wake, (job_id, waits_for(name)))
            if cursor.rowcount == 1:  # it waited for this event: wake its queue's listening workers now
                announce(cursor, [found[2]])
        return job_id

    return db.run(work, using)


def _job_id(cursor: Any, job: int | str | Job) -> int:
    if isinstance(job, Job):
        return job.pk
    if isinstance(job, int) and not isinstance(job, bool):
        return job
    if isinstance(job, str):
        cursor.execute(sql.steps(cursor.db).by_key, (job,))
        found = cursor.fetchone()
        if found is None:
            raise ValueError(f"no unfinished job pushed with key {job!r}: the event was not sent")
        return found[0]
    raise ValueError(f"send an event to a Job, a job id or a job's key, not {job!r}")


def request_cancel(ids: Sequence[int], using: str | None = None) -> int:
    """Ask the running attempts of these jobs to stop; returns how many were asked (their
    workers learn it at their next heartbeat)."""
    ids = list(ids)
    if not ids:
        return 0

    def work(cursor: Any, resumed: bool) -> int:
        cursor.execute(sql.steps(cursor.db).request_cancel + in_list(ids), ids)
        return cursor.rowcount

    return db.run(work, db.alias(using))


def cancel_requested(worker: str, ids: Sequence[int], using: str) -> set[int]:
    """Which of `worker`'s running jobs (`ids`) were asked to stop."""
    ids = list(ids)
    if not ids:
        return set()

    def work(cursor: Any, resumed: bool) -> set[int]:
        cursor.execute(sql.steps(cursor.db).cancel_requested + in_list(ids), (worker, *ids))
        return {row[0] for row in cursor.fetchall()}

    return db.run(work, using)


def delete_with(cursor: Any, job_ids: Sequence[int]) -> None:
    """Delete the steps and events of jobs about to be deleted, in the caller's transaction."""
    st = sql.steps(cursor.db)
    cursor.execute(st.delete_steps + in_list(job_ids), list(job_ids))
    cursor.execute(st.delete_events + in_list(job_ids), list(job_ids))
