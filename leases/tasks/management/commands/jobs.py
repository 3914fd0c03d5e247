"""`manage.py jobs`: list, show, count, retry, cancel, discard and wait for queued jobs,
and send events to durable ones.

Every read stays quick on a table of millions of finished jobs: `list` reads the newest
rows by primary key, `stats` runs a fixed handful of grouped queries over the claim and
finished_at indexes (leases.tasks.jobs.counts), and nothing counts the whole table.

Jobs of internal handlers (an app's bookkeeping, such as a pipeline's advance event)
are not operators' work: `list` leaves them out unless asked (`--internal`, `--all`, or
`--name` naming one), and `stats` counts them on a line of their own.

Exit codes: 0 done; 1 `wait` saw the job fail, die or be cancelled (or deleted), or a job
named by id was left alone by `retry`, `cancel` or `discard` (not in a status the action
takes; the line says which); 2 bad input (nothing written); 75 (EX_TEMPFAIL) `wait` timed
out, or the database is unavailable.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from leases import db, routing, targets
from leases.clock import db_now
from leases.durations import parse_duration
from leases.management.base import EX_TEMPFAIL, LeasesCommand, add_database_option
from leases.management.text import (
    MAX_LIMIT,
    ago,
    block,
    clock,
    elapsed,
    limit_of,
    parse_json,
    shown,
    standing_cells,
    table,
    when,
)
from leases.models import Resource
from leases.tasks import registry
from leases.tasks.jobs import actions, counts, waits
from leases.tasks.jobs.queues import all_queues, known_queues
from leases.tasks.jobs.steps import SHOWN, send_event, state, waiting
from leases.tasks.models import Job, JobError, JobEvent, JobStep

#: Seconds between two looks at the job in `wait`.
POLL = 0.5
#: Largest id a database key column holds; a bigger number names no job.
MAX_ID = 2**63 - 1
#: Characters of an error message in a table cell (`show --traceback` prints it whole).
ERROR_WIDTH = 100
#: Ids per call of the queue's actions.
BATCH = 500
#: Ids an error about ids that name no job lists.
IDS_SHOWN = 10
LABELS = dict(Job.STATUSES)
NAMES = list(LABELS.values())
_ID = re.compile(r"[0-9]+")
#: Per bulk action: its queue function, its verb, what a job it leaves alone is, the
#: statuses its --status takes, and its help.
ACTIONS = {
    "retry": (actions.retry, "retried", "not failed, dead or cancelled", ("failed", "dead", "cancelled"),
              "run failed, dead or cancelled jobs again now"),
    "cancel": (actions.cancel, "cancelled", "ended already", ("ready", "blocked"),
               "cancel waiting jobs; by id, running ones too (asked to stop at their worker's next heartbeat)"),
    "discard": (actions.discard, "discarded", "running", tuple(name for name in NAMES if name != "running"),
                "delete jobs that are not running, with their errors"),
}


def job_ids(texts: Sequence[str]) -> list[int]:
    """Job ids as typed, each once, in order; ValueError (exit 2) for anything but a whole
    number that a key column can hold."""
    for text in texts:
        if not _ID.fullmatch(text) or not 0 < int(text) <= MAX_ID:
            raise ValueError(f"a job id is a whole number from 1 to {MAX_ID}, not {text!r}")
    return list(dict.fromkeys(int(text) for text in texts))


def status_name(text: str, allowed: Sequence[str] = NAMES, action: str = "") -> str:
    """A --status as typed; ValueError (exit 2) naming the valid ones otherwise."""
    if text not in NAMES:
        raise ValueError(f"--status must be one of {', '.join(NAMES)}, not {text!r}")
    if text not in allowed:
        raise ValueError(f"{action} --status must be {' or '.join(allowed)}, not {text!r}")
    return text


def relative(moment: datetime | None, now: datetime) -> str:
    """'in 3s' or '2m ago' by the database clock; '-' for no time."""
    return "-" if moment is None else ago(moment, now)


def cell(text: str) -> str:
    """A message for a table cell: printable, on one line, cut to ERROR_WIDTH."""
    text = shown(text)
    return text if len(text) <= ERROR_WIDTH else text[: ERROR_WIDTH - 3] + "..."


def existing(wanted: list[int], verb: str, using: str) -> dict[int, int]:
    """{id: status} of `wanted`, in order, once each is known to name a job; ValueError
    (exit 2, nothing done) naming those that do not."""
    jobs = Job.objects.using(using)
    found = {pk: status for start in range(0, len(wanted), BATCH)
             for pk, status in jobs.filter(pk__in=wanted[start : start + BATCH]).values_list("pk", "status")}
    missing = [pk for pk in wanted if pk not in found]
    if missing:
        raise ValueError(f"no job {listing(missing)}: nothing {verb}")
    return {pk: found[pk] for pk in wanted}


def listing(ids: Sequence[int]) -> str:
    """"#3, #4 and 12 more"."""
    more = f" and {len(ids) - IDS_SHOWN} more" if len(ids) > IDS_SHOWN else ""
    return ", ".join(f"#{pk}" for pk in ids[:IDS_SHOWN]) + more


def _holdings(rows: list[tuple], using: str) -> dict[int, str]:
    """{job id: "pool/name token N"} of the listed running jobs that hold a resource; none
    when no listed job needs one (the column is then left out)."""
    if not any(row[10] for row in rows):
        return {}
    running = {row[11]: (row[0], row[12]) for row in rows if row[3] == Job.RUNNING and row[11] is not None}
    names = dict(Resource.objects.using(using).filter(pk__in=list(running)).values_list("pk", "name"))
    pools = {row[0]: row[10] for row in rows}
    return {job: f"{shown(pools[job])}/{shown(names.get(rid, '?'))} token {token}"
            for rid, (job, token) in running.items()}


def find_job(text: str, using: str) -> Job:
    """The job named on the command line; ValueError (exit 2) when there is none."""
    number = job_ids([text])[0]
    found = Job.objects.using(using).filter(pk=number).first()
    if found is None:
        raise ValueError(f"no job #{number}")
    return found


class Command(LeasesCommand):
    help = (
        "List, show, count, retry, cancel, discard and wait for queued jobs, and send events to durable ones."
        " Exit codes: 0 done, 1 wait "
        "saw the job fail, die or be cancelled, or a job named by id was left alone (not in a status the "
        "action takes), 2 bad input (nothing written), 75 wait timed out or the database is unavailable."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        statuses = ", ".join(NAMES)
        sub = parser.add_subparsers(dest="action", required=True)
        listing = sub.add_parser("list", help="jobs, newest first")
        listing.add_argument("--queue", help="only jobs of this queue")
        listing.add_argument("--status", help=f"only jobs in this status ({statuses})")
        listing.add_argument("--name", help="only jobs of this handler")
        listing.add_argument("--limit", default="50", help=f"jobs shown (default 50, at most {MAX_LIMIT})")
        which = listing.add_mutually_exclusive_group()
        which.add_argument("--internal", action="store_true",
                           help="only jobs apps make for their own bookkeeping (a pipeline's advance event)")
        which.add_argument("--all", dest="show_all", action="store_true",
                           help="operators' jobs and internal ones")
        show = sub.add_parser("show", help="every field of a job, and the error of each failed attempt")
        show.add_argument("job", help="the job's id")
        show.add_argument("--traceback", action="store_true", help="print each error's traceback too")
        stats = sub.add_parser(
            "stats", help="per queue: ready, blocked, running, due, oldest due, ended in the last hour; "
                          "internal jobs on a line of their own"
        )
        stats.add_argument("--queue", help="only this queue")
        for action, (_, _, _, allowed, text) in ACTIONS.items():
            one = sub.add_parser(action, help=f"{text}, by id or all in a status")
            one.add_argument("ids", nargs="*", metavar="ID", help="the jobs' ids")
            one.add_argument("--status", help=f"instead of ids, all jobs in a status: {', '.join(allowed)}")
            required = " (required: one queue at a time)" if action == "cancel" else ""
            one.add_argument("--queue", help=f"with --status: only jobs of this queue{required}")
            if action == "discard":
                one.add_argument(
                    "--older-than",
                    help="with --status: only jobs that finished (or, not finished, were queued) longer ago "
                         "than this, e.g. 12h, 7d",
                )
        send = sub.add_parser("send-event", help="send an event to a durable job: a wait for it takes it")
        send.add_argument("job", nargs="?", help="the job's id (or --key)")
        send.add_argument("event", help="the event's name")
        send.add_argument("--key", help="instead of an id: the key the job was pushed with")
        send.add_argument("--data", default="null", help="the event's data, as JSON (default null)")
        wait = sub.add_parser("wait", help="wait for a job to end: exit 0 succeeded, 1 failed/dead/cancelled")
        wait.add_argument("job", help="the job's id")
        wait.add_argument("--timeout", default="30s", help="exit 75 after this, e.g. 90, 10m (default 30s)")
        add_database_option(*sub.choices.values())

    def handle(self, *args: Any, action: str, database: str | None, **options: Any) -> None:
        # Jobs of one database: --database, else the one --queue is routed to, else LEASES_DATABASE.
        queue = options.get("queue")
        self.using = routing.route("queues", queue, database) if queue else routing.known(database or db.alias())
        if action in ACTIONS:
            self._act(action, **options)
        else:
            getattr(self, f"_{action.replace('-', '_')}")(**options)

    def _list(self, queue: str | None, status: str | None, name: str | None, limit: str, internal: bool,
              show_all: bool, **options: Any) -> None:
        count = limit_of(limit)
        using = self.using
        jobs = Job.objects.using(using).order_by("-pk")
        if status is not None:
            jobs = jobs.filter(status=status_name(status))
        if queue is not None:
            jobs = jobs.filter(queue=queue)
        if name is not None:
            jobs = jobs.filter(name=name)
        hidden = registry.internal_names()
        asked = jobs
        if internal:
            jobs = jobs.filter(name__in=hidden)
        elif hidden and not show_all and name not in hidden:  # --name of one shows it: it was asked for
            jobs = jobs.exclude(name__in=hidden)
        else:
            hidden = frozenset()
        now = db_now(using)
        rows = list(jobs.values_list(
            "pk", "name", "queue", "status", "attempt", "max_attempts", "run_at", "worker", "finished_at",
            "expires_at", "pool", "resource_id", "lease_token", "waiting_for",
        )[:count])
        holds = _holdings(rows, using)
        lines = [["ID", "NAME", "QUEUE", "STATUS", "ATTEMPTS", "RUN AT", "WORKER", "FINISHED", *(["HOLDS"] * bool(holds))]]
        for pk, job_name, job_queue, code, attempt, attempts, run_at, worker, finished_at, expires_at, *_, waits_for in rows:
            lines.append([
                str(pk), shown(job_name), shown(job_queue), Job.describe(code, attempt, expires_at, now, shown(waits_for)),
                f"{attempt}/{attempts}", relative(run_at, now), shown(worker) or "-",
                clock(finished_at) or "-", *([holds.get(pk, "-")] * bool(holds)),
            ])
        if len(lines) > 1:
            self.stdout.write(table(lines))
        elif name is not None and name not in registry.registered() and not Job.objects.using(using).filter(
                name=name).exists():  # a typo, as far as anyone can tell: a second read, only then
            known = ", ".join(sorted(n for n, spec in registry.registered().items() if not spec.internal))
            raise ValueError(f"no handler or job named {name!r} (known handlers: {known or 'none'})")
        elif hidden and asked.filter(name__in=hidden).exists():  # a second read, only when none is listed
            self.stdout.write("no jobs but internal ones (--all shows them)")
        else:
            self.stdout.write("no jobs")

    def _show(self, job: str, traceback: bool, **options: Any) -> None:
        using = self.using
        found = find_job(job, using)
        now = db_now(using)
        running = found.status == Job.RUNNING
        head = [
            ["job", f"#{found.pk}"],
            ["name", shown(found.name)],
            ["queue", shown(found.queue)],
            ["backend", shown(found.backend) or "- (a native handler job)"],
            ["status", Job.describe(found.status, found.attempt, found.expires_at, now, shown(found.waiting_for))],
            ["priority", str(found.priority)],
            ["attempts", f"{found.attempt}/{found.max_attempts}"],
            ["claims", str(found.claims)],
            ["pushes", str(found.pushes)],
            ["key", shown(found.key)],
            ["pending key", shown(found.pending_key or "") or "-"],
            ["limit key", shown(found.limit_key) or "-"],
            ["concurrency", "-" if found.concurrency is None else str(found.concurrency)],
            ["rate", shown(found.rate) or "-"],
            ["on finish", shown(found.on_finish) or "-"],
            ["worker", shown(found.worker) or "-"],
            ["run at", when(found.run_at, now)],
            ["enqueued", when(found.enqueued_at, now)],
            ["started", when(found.started_at, now)],
            ["finished", when(found.finished_at, now)],
            ["expires", when(found.expires_at, now)],
            ["bounced", when(found.bounced_at, now)],
            ["duration", elapsed(found.started_at, found.finished_at, now if running else None) or "-"],
        ]
        if found.pool:  # a job that holds a resource while it runs
            held = _holdings([(found.pk, "", "", found.status, 0, 0, None, "", None, None, found.pool,
                               found.resource_id, found.lease_token)], using).get(found.pk, "-")
            head += [["pool", shown(found.pool)], ["target", shown(found.target) or "-"],
                     ["affinity", shown(found.affinity) or "-"], ["holds", held]]
            if found.status == Job.READY and not found.waiting_for and found.run_at <= now:
                head.append(["resources", shown(waits.of_job(found, using).summary(lambda at: ago(at, now)))])
        if found.status == Job.READY and found.waiting_for:  # a durable job, suspended
            head.append(["waits for", waiting(shown(found.waiting_for), found.run_at, now, lambda at: when(at, now))])
        if found.cancel_requested_at is not None and found.status == Job.RUNNING:
            head.append(["cancel asked", when(found.cancel_requested_at, now)])
        self.stdout.write(table(head))
        self.stdout.write(block("payload", found.payload))
        self.stdout.write(block("result", found.result))
        self._steps(found, now)
        self._verdicts(found)
        errors = list(JobError.objects.using(using).filter(job_id=found.pk).order_by("attempt", "pk"))
        if not errors:
            self.stdout.write("no errors")
            return
        lines = [["ATTEMPT", "EXCEPTION", "MESSAGE", "WORKER", "AT"]]
        for error in errors:
            lines.append([str(error.attempt), shown(error.exception), cell(error.message) or "-",
                          shown(error.worker) or "-", clock(error.at)])
        self.stdout.write(f"errors ({len(errors)}):\n" + table(lines))
        for error in errors if traceback else []:
            self.stdout.write(f"\nattempt {error.attempt} traceback:")
            for line in (error.traceback or "(none recorded)").splitlines():
                self.stdout.write("  " + shown(line))

    def _verdicts(self, found: Job) -> None:
        """The bans and rests its attempts gave the resources they held (the log's lines)."""
        said = targets.history(self.using, job=found.pk, limit=SHOWN)[::-1]
        if not said:
            return
        lines = [["AT", "RESOURCE", "TARGET", "VERDICT", "UNTIL", "REASON"]]
        for line in said:
            lines.append([clock(line.at), shown(f"{line.pool}/{line.name}"), shown(line.target),
                          line.get_kind_display(), clock(line.until) or "-", cell(line.reason) or "-"])
        self.stdout.write(f"bans and rests its attempts met ({len(said)}):\n" + table(lines))

    def _steps(self, found: Job, now: datetime) -> None:
        """A durable job's last SHOWN steps in order (a result cut to one line) and the
        events sent to it that no wait took yet (the oldest SHOWN); nothing for a job that
        never stepped."""
        stored = list(JobStep.objects.using(self.using).filter(job_id=found.pk).order_by("-seq")[:SHOWN])[::-1]
        pending = list(JobEvent.objects.using(self.using).filter(job_id=found.pk, taken_seq=None)
                       .order_by("pk")[:SHOWN])
        if stored:
            lines = [["STEP", "NAME", "STATE", "AT", "RESULT"]]
            for step in stored:
                lines.append([str(step.seq), shown(step.name), state(step, now, lambda at: ago(at, now)),
                              clock(step.at),
                              cell(json.dumps(step.result)) if step.done else "-"])
            count = f"the last {len(stored)} of {stored[-1].seq}" if stored[0].seq > 1 else len(stored)
            self.stdout.write(f"steps ({count}):\n" + table(lines))
        if pending:
            lines = [["EVENT", "SENT", "DATA"]] + [[shown(e.name), clock(e.sent_at), cell(json.dumps(e.data))]
                                                   for e in pending]
            self.stdout.write(f"events not yet taken ({len(pending)}):\n" + table(lines))

    def _stats(self, queue: str | None, **options: Any) -> None:
        using = self.using
        now = db_now(using)
        found = counts.by_queue(now, queue, using)
        internal = found.pop(counts.INTERNAL, None)
        settings = all_queues(using)
        names = sorted(set(settings) | set(found))
        if queue is not None:
            known = names if queue in names else sorted(known_queues(using))
            if queue not in known:
                raise ValueError(f"no queue named {queue!r} (known: {', '.join(known) or 'none'})")
            names = [queue]
        # Each column counts one status, as `jobs list --status` names it (READY leaves out
        # BLOCKED); DUE: the ready jobs whose time has come.
        lines = [["QUEUE", "READY", "BLOCKED", "RUNNING", "DUE", "OLDEST DUE", "SUCCEEDED/1H", "FAILED/1H",
                  "DEAD/1H", "PAUSED"]]
        for name in names:
            lines.append([shown(name), *self._counts(found.get(name), now),
                          "yes" if name in settings and settings[name].paused else "no"])
        if internal is not None:
            lines.append([counts.INTERNAL, *self._counts(internal, now), "-"])
        self.stdout.write(table(lines) if names else "no queues")
        for name, n in sorted(counts.suspended(using).items()):  # durable jobs holding no worker
            if name in names:
                self.stdout.write(f"queue {shown(name)}: {n['sleeping']} durable job(s) sleeping,"
                                  f" {n['waiting']} waiting for an event")
        self._resources(using)

    def _resources(self, using: str) -> None:
        """Due jobs that need a resource, by pool and target: how many slots could start
        them now, why the others cannot, and when the first of those comes back."""
        found = waits.waiting(using)
        if not found:
            return
        filters = any(wait.where for wait in found)
        lines = [["POOL", "TARGET", *(["WHERE"] if filters else []), "DUE", "USABLE", "NOT USABLE", "NEXT USABLE"]]
        for wait in found:
            where = [shown(json.dumps(wait.where, sort_keys=True)) if wait.where else "-"] if filters else []
            lines.append([shown(wait.pool), shown(wait.target) or "-", *where, str(wait.due),
                          *standing_cells(wait.standing)])
        self.stdout.write("due jobs that need a resource:\n" + table(lines))
        left = waits.more_than_shown(using) if len(found) == waits.SHOWN else 0
        if left:
            self.stdout.write(f"... and {left} more pool(s) and target(s) with fewer due jobs"
                              " (`lease targets POOL --target TARGET` shows one)")

    @staticmethod
    def _counts(of: dict[str, Any] | None, now: datetime) -> list[str]:
        """The counted cells of a line of `stats`."""
        of = of or {}
        return [*(str(of.get(field, 0)) for field in ("ready", "blocked", "running", "due")),
                relative(of.get("oldest"), now),
                *(str(of.get(field, 0)) for field in ("succeeded", "failed", "dead"))]

    def _act(self, action: str, ids: list[str], status: str | None, queue: str | None, verbosity: int,
             older_than: str | None = None, **options: Any) -> None:
        """Retry, cancel or discard the jobs named by id, or every job in a status a batch
        at a time, through leases.tasks.queue; all that was typed is checked first, every
        id included: one that names no job is bad input, and nothing is done."""
        call, verb, skipped, allowed, _ = ACTIONS[action]
        if ids and (status is not None or queue is not None or older_than is not None):
            raise ValueError(f"{action}: give job ids or --status, not both")
        if not ids and status is None:
            raise ValueError(f"{action}: give job ids, or --status ({' or '.join(allowed)})")
        if action == "cancel" and status is not None and queue is None:
            raise ValueError("cancel --status needs --queue: one queue's waiting jobs at a time")
        using = self.using
        done = seen = 0
        batches: Iterable[list[int]]
        named: dict[int, int] = {}
        if status is None:  # ids, as checked above
            named = existing(job_ids(ids), verb, using)
            wanted = list(named)
            batches = (wanted[start : start + BATCH] for start in range(0, len(wanted), BATCH))
        else:
            name = status_name(status, allowed, action)
            try:
                seconds = None if older_than is None else parse_duration(older_than, unit=True)
            except ValueError as exc:
                raise ValueError(f"--older-than: {exc}") from None
            before = None if seconds is None else db_now(using) - timedelta(seconds=seconds)
            batches = actions.select_batches(name, queue=queue, before=before, size=BATCH, using=using)
        for batch in batches:
            done += call(batch, using=using)
            seen += len(batch)
            if verbosity > 1:
                self.stderr.write(f"{verb} {done} of {seen} so far")
        by_id = (*allowed, "running") if action == "cancel" else allowed  # a running job, named, is asked to stop
        left = [pk for pk, code in named.items() if LABELS[code] not in by_id]
        if named and done < seen:
            # Named by id, a job left alone is news a script must see: exit 1, saying why.
            why = ", ".join(f"#{pk} is {LABELS[named[pk]]}" for pk in left[:IDS_SHOWN]) or "they changed meanwhile"
            raise CommandError(f"{verb} {done} of {seen}: {seen - done} {skipped} ({why})", returncode=1)
        if verbosity > 0:
            detail = f" ({seen - done} {skipped})" if seen > done else ""
            running = sum(code == Job.RUNNING for code in named.values()) if action == "cancel" else 0
            detail += f" ({running} running: asked to stop)" if running else ""
            self.stdout.write(f"{verb} {done} of {seen}{detail}")

    def _send_event(self, job: str | None, event: str, key: str | None, data: str, **options: Any) -> None:
        """Send an event to a job named by id or key; bad JSON, a job that does not exist
        or has ended is bad input (exit 2), nothing sent."""
        if job is not None and key is not None:
            raise ValueError("send-event: give the job's id or --key, not both")
        if job is None and key is None:
            if re.fullmatch(r"#?\d+", event.strip()):  # an id alone: argparse took it for the event's name
                raise ValueError(f"send-event: the event's name is missing (jobs send-event {event.strip()} EVENT)")
            raise ValueError("send-event: give the job's id (jobs send-event JOB EVENT) or --key KEY")
        value = parse_json(data, "--data")  # one line for nesting too deep as well
        target = key if key is not None else job_ids([job])[0]
        job_id = send_event(target, event, value, using=self.using)
        self.stdout.write(f"sent the event {shown(event)!r} to job #{job_id}")

    def _wait(self, job: str, timeout: str, **options: Any) -> None:
        try:
            limit = parse_duration(timeout)
        except ValueError as exc:
            raise ValueError(f"--timeout: {exc}") from None
        using = self.using
        found = find_job(job, using)
        deadline = time.monotonic() + limit
        rows = Job.objects.using(using).filter(pk=found.pk).values_list("status", flat=True)
        while True:
            status = rows.first()
            if status is None:
                raise CommandError(f"job #{found.pk} was deleted", returncode=1)
            if status in Job.FINISHED:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                message = f"job #{found.pk} is still {LABELS[status]} after {limit:g}s"
                raise CommandError(message, returncode=EX_TEMPFAIL)
            time.sleep(min(POLL, left))
        if status == Job.SUCCEEDED:
            self.stdout.write(f"job #{found.pk} succeeded")
            return
        last = JobError.objects.using(using).filter(job_id=found.pk).order_by("-attempt", "-pk").first()
        detail = f": {last.exception}: {last.message} (attempt {last.attempt})" if last else ""
        raise CommandError(f"job #{found.pk} {LABELS[status]}{shown(detail)}", returncode=1)
