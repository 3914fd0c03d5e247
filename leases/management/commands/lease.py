"""`manage.py lease`: manage resource pools, and run a command while holding a lease.

Exit codes: 0 done; 2 bad input (nothing written); 75 (EX_TEMPFAIL) the database is
unreachable, no free resource within --wait, or `run` lost its lease and stopped its
command; 127 `run` could not start its command. Otherwise `run` exits with its
command's code (128 + N when the command died of signal N).
"""
from __future__ import annotations

import getpass
import json
import logging
import os
import signal
import socket
import subprocess
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import Error

from leases import routing, targets
from leases.clock import db_now
from leases.durations import parse_duration
from leases.exceptions import NoResourceAvailable, UnknownPool, UnknownResource
from leases.lease import Heartbeat, Lease, job_of, release_within
from leases.management.base import EX_TEMPFAIL, EX_USAGE, LeasesCommand, add_database_option
from leases.management.lines import bad_line, entries
from leases.management.text import ago, clock, limit_of, parse_json, shown, span, table
from leases.models import RESOURCE_NAME_LENGTH, Resource
from leases.pool import Pool, check_data, unknown_pool
from leases.progress import progress_bar
from leases.validation import check_name, check_seconds, check_target, check_ttl, check_wait

log = logging.getLogger("leases")

EX_NOTFOUND = 127
#: How often `run` checks its command and its lease, in seconds.
POLL = 0.1
#: The longest `run` waits, after its command ended, to stop the heartbeat and release.
#: Past it the lease is left to free itself when its ttl runs out.
RELEASE_WAIT = 5.0


POOL_HELP = "the pool's name (pools exist while they have resources)"


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
        if self.verbatim is None:
            return super().parse_known_args(args, namespace)
        if "--" not in args:
            namespace, extras = super().parse_known_args(args, namespace)
            if extras:  # the command's own options, taken for ours
                self.error(f"unrecognized arguments: {' '.join(extras)}; put the command after --, as in "
                           f"`lease run POOL [--ttl 90s] -- {' '.join(getattr(namespace, self.verbatim) + extras)}`")
            return namespace, extras
        cut = args.index("--")
        namespace, extras = super().parse_known_args(args[:cut], namespace)
        setattr(namespace, self.verbatim, args[cut + 1 :])
        return namespace, extras


def duration(text: str, option: str, zero: bool = False) -> float:
    """A duration option (90, 90s, 10m, 2h), its name in the error."""
    try:
        return parse_duration(text, zero=zero)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


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
        add.add_argument("pool", help=POOL_HELP)
        add.add_argument("name", help="the resource's name, unique in its pool (e.g. a proxy's host:port)")
        add.add_argument("--data", help="the resource's data, as JSON")
        add.add_argument("--slots", default="1", help="holders it may have at once, each with its own lease (default 1)")
        imp = sub.add_parser(
            "import", help="add the resources of FILE, all or none: lines `name` or `name,json-data`"
        )
        imp.add_argument("pool", help=POOL_HELP)
        imp.add_argument("file", help="lines `name` or `name,json-data`; # starts a comment")
        listing = sub.add_parser("list", help="resources with their state by the database clock")
        listing.add_argument("pool", nargs="?", help="only this pool (default: every pool)")
        for action, text in [
            ("remove", "delete a resource"),
            ("release", "free a held resource, whoever holds it"),
            ("unquarantine", "put a quarantined resource back in service"),
        ]:
            one = sub.add_parser(action, help=text)
            one.add_argument("pool", help=POOL_HELP)
            one.add_argument("name", help="the resource's name")
        quarantine = sub.add_parser("quarantine", help="take a resource out of service")
        quarantine.add_argument("pool", help=POOL_HELP)
        quarantine.add_argument("name", help="the resource's name")
        quarantine.add_argument(
            "--for", dest="period", default="1d", help="e.g. 90s, 10m, 2h, 1d (default 1d)"
        )
        quarantine.add_argument("--reason", default="", help="why, shown by list and the admin")
        said = sub.add_parser(
            "targets",
            help="what targets (sites) say of resources: bans, rests and paces in force, or their history",
            description="The bans, rests and paces in force, by pool, resource and target. With POOL and "
                        "--target, first how the pool stands for that target: how many resources could start "
                        "its work now, why the others cannot, and when the first comes back. --history: the "
                        "log of bans, rests and lifts instead, newest first, with who said each.")
        said.add_argument("pool", nargs="?", help="only this pool (default: every pool)")
        said.add_argument("--target", help="only this target (a site)")
        said.add_argument("--resource", help="only this resource")
        said.add_argument("--history", action="store_true", help="the log of bans, rests and lifts instead")
        said.add_argument("--limit", default="50", help="lines of --history at most (default 50)")
        lift = sub.add_parser(
            "lift", help="end the bans and rests of a resource (every target's, or --target's), or of a target "
                         "(every resource's); logged")
        lift.add_argument("pool", help=POOL_HELP)
        lift.add_argument("name", nargs="?", help="the resource (default: every resource, with --target)")
        lift.add_argument("--target", help="only this target's (default: every target's, with a resource)")
        lift.add_argument("--reason", default="", help="why, kept in the history")
        stats = sub.add_parser("stats", help="slots free, held, cooling, quarantined and total, as JSON")
        stats.add_argument("pool", help=POOL_HELP)
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
        run.add_argument("pool", help="the pool to lease a resource of")
        run.add_argument("--ttl", default="60", help="how long the lease lasts unless renewed: 90s, 10m (default 60s)")
        run.add_argument("--wait", default="300", help="how long to wait for a free resource, 0 not at all (default 5m)")
        run.add_argument("--grace", default="10", help="time from SIGTERM to SIGKILL when the lease is lost (default 10s)")
        run.add_argument("command", nargs="*", help="after --: the command and its arguments")
        add_database_option(*sub.choices.values())

    def handle(self, *args: Any, action: str, pool: str | None, **options: Any) -> None:
        try:
            database = options.pop("database")
            getattr(self, f"_{action}")(None if pool is None else Pool(pool, using=database), database=database,
                                        **options)
        except (UnknownPool, UnknownResource) as exc:
            raise CommandError(str(exc), returncode=EX_USAGE) from None
        except NoResourceAvailable as exc:
            raise CommandError(str(exc), returncode=EX_TEMPFAIL) from None

    def _add(self, pool: Pool, name: str, data: str | None, slots: str, **options: Any) -> None:
        try:
            count = int(slots)
        except ValueError:
            raise ValueError(f"--slots must be a whole number, not {slots!r}") from None
        created = pool.add(name, None if data is None else parse_json(data, "--data"), slots=count)
        what = f"{pool.name}/{shown(name)}" + (f" ({count} slots)" if count > 1 else "")
        self.stdout.write(f"{'added' if created else 'already there:'} {what}")

    def _import(self, pool: Pool, file: str, **options: Any) -> None:
        resources = read_resources(file)
        before = pool.resources().count()
        with progress_bar(len(resources), f"importing into {pool.name}", self.stderr) as bar:
            pool.add_many(resources.items(), progress=bar.update)
        added = pool.resources().count() - before
        self.stdout.write(f"{added} added to {pool.name} ({len(resources) - added} already there)")

    def _list(self, pool: Pool | None, database: str | None, **options: Any) -> None:
        if pool:
            found = [(pool.using, list(pool.resources()))]
            if not found[0][1]:
                raise unknown_pool(pool.name, pool.using)
        else:  # every pool of every database in use, or of the one asked for
            aliases = [routing.known(database)] if database else routing.aliases()
            found = [(alias, list(Resource.objects.using(alias))) for alias in aliases]
        header = ["POOL", "NAME", "SLOT", "USED", "STATE", "HOLDER", "EXPIRES", "TOKEN", "QUARANTINE"]
        lines = []
        for alias, rows in found:
            lines += self._lines(rows, db_now(alias), [alias] if len(found) > 1 else [])
        first = 1 if pool else 0  # one pool: no POOL column
        if not lines:
            self.stdout.write("no resources")
            return
        lines = [(["DATABASE"] if len(found) > 1 else []) + header] + lines
        self.stdout.write(table([line[:-9] + line[-9:][first:] for line in lines]))

    @staticmethod
    def _lines(rows: list[Resource], now: Any, prefix: list[str]) -> list[list[str]]:
        """One line per slot, judged by `now` (the clock of the rows' database). EXPIRES:
        when a held or cooling slot is free again ("in 2m"), in the words every command
        uses for a time left; a quarantined one, which nobody holds, says in QUARANTINE
        until when, and why."""
        states = {r.pk: r.state_at(now) for r in rows}
        used: dict[tuple[str, str], list[int]] = {}  # (pool, name) -> [held slots, slots]
        for r in rows:
            count = used.setdefault((r.pool, r.name), [0, 0])
            count[0] += states[r.pk] == Resource.HELD
            count[1] += 1
        lines = []
        for r in rows:
            state = states[r.pk]
            held, slots = used[(r.pool, r.name)]
            line = [shown(r.pool), shown(r.name), str(r.slot), f"{held}/{slots}", state, "", "", str(r.token), ""]
            if state in (Resource.HELD, Resource.COOLING):
                line[5], line[6] = _holder(r.holder) if state == Resource.HELD else "", ago(r.busy_before, now)
            elif state == Resource.QUARANTINED:
                why = f": {shown(r.quarantine_reason)}" if r.quarantine_reason else ""
                line[8] = f"until {clock(r.quarantined_until)} ({ago(r.quarantined_until, now)}){why}"
            lines.append(prefix + line)
        return lines

    def _remove(self, pool: Pool, name: str, **options: Any) -> None:
        if not pool.remove(name):
            raise UnknownResource(f"no resource {name!r} in pool {pool.name!r}")
        self.stdout.write(f"removed {pool.name}/{shown(name)}")

    def _release(self, pool: Pool, name: str, **options: Any) -> None:
        released = pool.release(name)
        where = f"{pool.name}/{shown(name)}"
        self.stdout.write(f"released {where}" if released else f"{where} was not held")

    def _quarantine(self, pool: Pool, name: str, period: str, reason: str, **options: Any) -> None:
        seconds = duration(period, "--for")
        pool.quarantine(name, seconds, reason)
        self.stdout.write(f"quarantined {pool.name}/{shown(name)} for {span(seconds)}")

    def _unquarantine(self, pool: Pool, name: str, **options: Any) -> None:
        done = pool.unquarantine(name)
        state = "is back in service" if done else "was not quarantined"
        self.stdout.write(f"{pool.name}/{shown(name)} {state}")

    def _targets(self, pool: Pool | None, database: str | None, target: str | None, resource: str | None,
                 history: bool, limit: str, **options: Any) -> None:
        target = None if target is None else check_target(target)
        resource = None if resource is None else check_name(resource, "resource name", RESOURCE_NAME_LENGTH)
        count = limit_of(limit)
        if pool is not None and not pool.resources().exists():
            raise unknown_pool(pool.name, pool.using)
        aliases = [pool.using] if pool else [routing.known(database)] if database else routing.aliases()
        name = pool.name if pool else None
        if history:
            lines = [line for alias in aliases for line in targets.history(alias, name, resource, target, limit=count)]
            self.stdout.write(self._said(sorted(lines, key=lambda v: (v.at, v.pk), reverse=True)[:count]))
            return
        if pool is not None and target is not None:
            standing = targets.standing(pool.name, target, using=pool.using)
            self.stdout.write(f"{pool.name}: {standing.summary(lambda at: ago(at, standing.now))}")
        found = [targets.in_force(alias, name, target, resource) for alias in aliases]
        lines = [["POOL", "NAME", "TARGET", "BANNED", "RESTING", "PACED", "REASON"]]
        for now, rows in found:
            for row in rows:
                times = [ago(at, now) if at is not None and at > now else "-"
                         for at in (row.banned_until, row.rested_until, row.next_start_at)]
                lines.append([shown(row.pool), shown(row.name), shown(row.target), *times, shown(row.ban_reason) or "-"])
        self.stdout.write(table(lines) if len(lines) > 1 else "no bans, rests or paces in force")

    @staticmethod
    def _said(lines: list[Any]) -> str:
        """The log's lines as a table, newest first."""
        if not lines:
            return "no bans, rests or lifts logged"
        rows = [["AT", "POOL", "NAME", "TARGET", "VERDICT", "UNTIL", "BY", "REASON"]]
        for line in lines:
            rows.append([clock(line.at), shown(line.pool), shown(line.name), shown(line.target),
                         line.get_kind_display(), clock(line.until) or "-", _holder(line.holder) or "-",
                         shown(line.reason) or "-"])
        return table(rows)

    def _lift(self, pool: Pool, name: str | None, target: str | None, reason: str, **options: Any) -> None:
        if name is None and target is None:
            raise ValueError("lift: name a resource, --target, or both (a whole pool is not lifted at once)")
        target = None if target is None else check_target(target)
        if not pool.resources().exists():
            raise unknown_pool(pool.name, pool.using)
        if name is not None and not pool.resources().filter(name=name).exists():
            raise UnknownResource(f"no resource {name!r} in pool {pool.name!r}")
        who = f"lease lift ({getpass.getuser()}@{socket.gethostname()})"
        lifted = targets.lift(pool.name, name or "", target or "", using=pool.using, by=who, reason=reason)
        what = " ".join(filter(None, [name and shown(name), target and f"for {shown(target)}"]))
        if not lifted:
            self.stdout.write(f"nothing to lift: no ban or rest of {pool.name} {what} in force")
            return
        for lifted_name, lifted_target in lifted:
            log.info("%s lifted the bans and rests of %s/%s for %s", who, pool.name, lifted_name, lifted_target)
        pairs = ", ".join(f"{shown(n)} for {shown(t)}" for n, t in lifted)
        self.stdout.write(f"lifted the bans and rests of {pool.name}: {pairs}")

    def _stats(self, pool: Pool, **options: Any) -> None:
        stats = pool.stats()
        if not stats["total"]:
            raise unknown_pool(pool.name, pool.using)
        self.stdout.write(json.dumps(stats))

    def _run(
        self, pool: Pool, ttl: str, wait: str, grace: str, command: list[str], **options: Any
    ) -> None:
        if not command:
            raise ValueError("no command given (lease run POOL [options] -- COMMAND ARGS...)")
        ttl = check_ttl(duration(ttl, "--ttl"))
        wait = check_wait(duration(wait, "--wait", zero=True))
        grace = check_seconds(duration(grace, "--grace", zero=True), "grace")
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


def _holder(holder: str) -> str:
    """Who holds a slot: a job of the queue as "job #45 (worker)", anyone else as named."""
    found = job_of(holder)
    return f"job #{found[1]} ({shown(found[0])})" if found else shown(holder)
