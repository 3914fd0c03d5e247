"""`manage.py lease`: manage resource pools, and run a command while holding a lease.

Exit codes: 0 done; 2 bad input (nothing written); 75 (EX_TEMPFAIL) the database is
unreachable, no free resource within --wait, or `run` lost its lease and stopped its
command; 127 `run` could not start its command. Otherwise `run` exits with its
command's code (128 + N when the command died of signal N).
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import Error

from leases import db
from leases.durations import parse_duration
from leases.management.base import EX_TEMPFAIL, EX_USAGE, LeasesCommand
from leases.management.lines import bad_line, entries
from leases.exceptions import NoResourceAvailable, UnknownPool, UnknownResource
from leases.lease import Heartbeat, Lease, release_within
from leases.models import RESOURCE_NAME_LENGTH, Resource
from leases.pool import Pool, check_data, db_now
from leases.validation import check_name, check_seconds, check_ttl, check_wait
from leases.progress import Progress

log = logging.getLogger("leases")

EX_NOTFOUND = 127
#: How often `run` checks its command and its lease, in seconds.
POLL = 0.1
#: The longest `run` waits, after its command ended, to stop the heartbeat and release.
#: Past it the lease is left to free itself when its ttl runs out.
RELEASE_WAIT = 5.0


class _Parser(CommandParser):
    """A subcommand parser that can hand everything after the first `--` on verbatim.

    argparse in Python 3.11 drops every `--` from a positional's values, which would
    change the argv of the command that `lease run` starts.
    """

    def __init__(self, *, verbatim: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.verbatim = verbatim

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = list(args or ())
        if self.verbatim is None or "--" not in args:
            return super().parse_known_args(args, namespace)
        cut = args.index("--")
        namespace, extras = super().parse_known_args(args[:cut], namespace)
        setattr(namespace, self.verbatim, args[cut + 1 :])
        return namespace, extras


def seconds(text: str, what: str) -> float:
    """A number, checked here rather than by argparse (whose errors come with the whole
    usage text, not one line); the bounds are the engine's to check."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number of seconds, not {text!r}") from None


def parse_json(text: str, what: str) -> Any:
    """`text` as JSON; ValueError (one line) when it is not, or is nested too deeply to
    parse (json.loads raises RecursionError for that)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def read_resources(path: str) -> dict[str, Any]:
    """Parse a file of `name` or `name,json-data` lines; say which line is wrong.

    The data is everything after the first comma (JSON has commas of its own). A name
    listed twice takes its last line.
    """
    resources: dict[str, Any] = {}
    for number, line in entries(path):
        name, comma, raw = line.partition(",")
        try:
            name = check_name(name.strip(), "resource name", RESOURCE_NAME_LENGTH)
            data = parse_json(raw, "data") if comma and raw.strip() else None
            resources[name] = check_data(data)
        except ValueError as exc:
            raise bad_line(path, number, line, exc) from None
    return resources


def shown(text: str) -> str:
    """`text` safe to print on a terminal: control and invisible characters (escape
    sequences, newlines, bidirectional overrides, zero-width spaces) as \\x.., \\u....

    Names are checked on the way in, but rows written earlier or through the ORM can
    hold anything, and a raw ESC would let a stored value drive the operator's terminal.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


class Command(LeasesCommand):
    help = (
        "Manage resource pools, or run a command while holding a lease. Exit codes: 0 done, "
        "2 bad input (nothing written), 75 database unreachable, no free resource within --wait "
        "or lease lost (run stopped its command), 127 run could not start its command; otherwise "
        "run exits with its command's code."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)
        add = sub.add_parser("add", help="add a resource (again: changes nothing, or only its data)")
        add.add_argument("pool")
        add.add_argument("name")
        add.add_argument("--data", help="the resource's data, as JSON")
        imp = sub.add_parser(
            "import", help="add the resources of FILE, all or none: lines `name` or `name,json-data`"
        )
        imp.add_argument("pool")
        imp.add_argument("file")
        listing = sub.add_parser("list", help="resources with their state by the database clock")
        listing.add_argument("pool", nargs="?")
        for action, text in [
            ("remove", "delete a resource"),
            ("release", "free a held resource, whoever holds it"),
            ("unquarantine", "put a quarantined resource back in service"),
        ]:
            one = sub.add_parser(action, help=text)
            one.add_argument("pool")
            one.add_argument("name")
        quarantine = sub.add_parser("quarantine", help="take a resource out of service")
        quarantine.add_argument("pool")
        quarantine.add_argument("name")
        quarantine.add_argument(
            "--for", dest="duration", default="1d", help="e.g. 90s, 10m, 2h, 1d (default 1d)"
        )
        quarantine.add_argument("--reason", default="")
        stats = sub.add_parser("stats", help="free, held, quarantined and total, as JSON")
        stats.add_argument("pool")
        run = sub.add_parser(
            "run",
            verbatim="command",
            usage="%(prog)s [--ttl TTL] [--wait WAIT] [--grace GRACE] pool -- command [arg ...]",
            help="lease a resource, run COMMAND with it, release it when COMMAND exits",
            description=(
                "Lease a resource of POOL and run COMMAND with LEASE_POOL, LEASE_NAME, LEASE_TOKEN "
                "and LEASE_DATA (JSON) in its environment, renewing the lease every ttl/3 seconds. "
                "SIGTERM and SIGINT are passed on to COMMAND. Exits with COMMAND's code; 75 if no "
                "resource was free within --wait, or if the lease was lost, in which case COMMAND "
                "gets SIGTERM and, --grace seconds later, SIGKILL."
            ),
        )
        run.add_argument("pool")
        run.add_argument("--ttl", default="60", help="lease seconds (default 60)")
        run.add_argument(
            "--wait", default="300", help="seconds to wait for a free resource (default 300)"
        )
        run.add_argument(
            "--grace", default="10", help="seconds from SIGTERM to SIGKILL (default 10)"
        )
        run.add_argument("command", nargs="*", help="after --: the command and its arguments")

    def handle(self, *args: Any, action: str, pool: str | None, **options: Any) -> None:
        try:
            getattr(self, f"_{action}")(None if pool is None else Pool(pool), **options)
        except (UnknownPool, UnknownResource) as exc:
            raise CommandError(str(exc), returncode=EX_USAGE) from None
        except NoResourceAvailable as exc:
            raise CommandError(str(exc), returncode=EX_TEMPFAIL) from None

    def _add(self, pool: Pool, name: str, data: str | None, **options: Any) -> None:
        created = pool.add(name, None if data is None else parse_json(data, "--data"))
        self.stdout.write(f"{'added' if created else 'already there:'} {pool.name}/{name}")

    def _import(self, pool: Pool, file: str, **options: Any) -> None:
        resources = read_resources(file)
        before = pool.resources().count()
        with Progress(len(resources), f"importing into {pool.name}", stream=self.stderr) as bar:
            pool.add_many(resources.items(), progress=bar.advance)
        added = pool.resources().count() - before
        self.stdout.write(f"{added} added to {pool.name} ({len(resources) - added} already there)")

    def _list(self, pool: Pool | None, **options: Any) -> None:
        rows = list(pool.resources() if pool else Resource.objects.using(db.alias()))
        if pool and not rows:
            raise UnknownPool(f"pool {pool.name!r} has no resources")
        now = db_now(pool.using if pool else None)
        lines = [["POOL", "NAME", "STATE", "HOLDER", "EXPIRES IN", "TOKEN", "QUARANTINE"]]
        for r in rows:
            state = r.state_at(now)
            line = [shown(r.pool), shown(r.name), state, "", "", str(r.token), ""]
            if state == Resource.HELD:
                line[3], line[4] = shown(r.holder), f"{math.ceil((r.busy_before - now).total_seconds())}s"
            elif state == Resource.QUARANTINED:
                line[4] = f"{math.ceil((r.quarantined_until - now).total_seconds())}s"
                line[6] = f"until {r.quarantined_until:%Y-%m-%d %H:%M:%S}Z {shown(r.quarantine_reason)}"
            lines.append(line)
        self.stdout.write(table([line[1:] if pool else line for line in lines]))

    def _remove(self, pool: Pool, name: str, **options: Any) -> None:
        if not pool.remove(name):
            raise UnknownResource(f"no resource {name!r} in pool {pool.name!r}")
        self.stdout.write(f"removed {pool.name}/{shown(name)}")

    def _release(self, pool: Pool, name: str, **options: Any) -> None:
        released = pool.release(name)
        where = f"{pool.name}/{shown(name)}"
        self.stdout.write(f"released {where}" if released else f"{where} was not held")

    def _quarantine(self, pool: Pool, name: str, duration: str, reason: str, **options: Any) -> None:
        seconds = parse_duration(duration)
        pool.quarantine(name, seconds, reason)
        self.stdout.write(f"quarantined {pool.name}/{shown(name)} for {seconds:g}s")

    def _unquarantine(self, pool: Pool, name: str, **options: Any) -> None:
        done = pool.unquarantine(name)
        state = "is back in service" if done else "was not quarantined"
        self.stdout.write(f"{pool.name}/{shown(name)} {state}")

    def _stats(self, pool: Pool, **options: Any) -> None:
        stats = pool.stats()
        if not stats["total"]:
            raise UnknownPool(f"pool {pool.name!r} has no resources")
        self.stdout.write(json.dumps(stats))

    def _run(
        self, pool: Pool, ttl: str, wait: str, grace: str, command: list[str], **options: Any
    ) -> None:
        if not command:
            raise ValueError("no command given (lease run POOL [options] -- COMMAND ARGS...)")
        ttl = check_ttl(seconds(ttl, "ttl"))
        wait = check_wait(seconds(wait, "wait"))
        grace = check_seconds(seconds(grace, "grace"), "grace")
        lease = pool.acquire(ttl=ttl, wait=wait)
        heartbeat = Heartbeat(lease)
        heartbeat.start()
        try:
            code = self._supervise(lease, command, grace)
        finally:
            self._let_go(lease, heartbeat)
        if code is None:
            why = "expired, released or quarantined" if lease.lost else "no renewal was answered in time"
            raise CommandError(f"{lease} was lost ({why}); stopped the command", returncode=EX_TEMPFAIL)
        if code:
            raise SystemExit(code)

    @staticmethod
    def _let_go(lease: Lease, heartbeat: Heartbeat) -> None:
        """Release, then stop the heartbeat, within RELEASE_WAIT seconds all told and
        never past the lease's local deadline (a lease that ran out is not worth waiting
        for), so a database that is down or hung cannot hold the exit. A release that
        fails or times out (a renewal stuck in the database keeps `Hold._lock`) is a
        warning, not a new exit code: the lease frees itself when its ttl runs out."""
        budget = min(RELEASE_WAIT, lease.remaining())
        deadline = time.monotonic() + budget
        try:
            release_within(lease, budget)
        except (Error, TimeoutError) as exc:
            log.warning("could not release %s (%s); it frees itself within %gs", lease, exc, lease.ttl)
        heartbeat.stop(deadline - time.monotonic())

    def _supervise(self, lease: Lease, command: list[str], grace: float) -> int | None:
        """Run `command` while `lease` holds: its exit code, or None if the lease was lost.

        Signal handlers only record signals; this loop passes them on, so a signal that
        arrives while the child is being started is not lost or sent twice.
        """
        received: list[int] = []
        previous = {
            s: signal.signal(s, lambda signum, frame: received.append(signum))
            for s in (signal.SIGTERM, signal.SIGINT)
        }
        child = None
        try:
            env = {
                **os.environ,
                "LEASE_POOL": lease.pool,
                "LEASE_NAME": lease.name,
                "LEASE_TOKEN": str(lease.token),
                "LEASE_DATA": json.dumps(lease.resource),
            }
            try:
                child = subprocess.Popen(command, env=env)
            except OSError as exc:
                raise CommandError(f"cannot run {command[0]}: {exc}", returncode=EX_NOTFOUND) from None
            while True:
                while received:
                    child.send_signal(received.pop(0))
                try:
                    code = child.wait(POLL)
                    return 128 - code if code < 0 else code
                except subprocess.TimeoutExpired:
                    if lease.lost or lease.remaining() <= 0:
                        return None
        finally:
            if child is not None and child.poll() is None:
                child.terminate()
                try:
                    child.wait(grace)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
