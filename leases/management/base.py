"""What every command of this app shares: one-line errors and the exit codes scripts test.

Exit codes: 2 bad input (nothing written), settings the system checks refuse and a
database that lacks this package's migrations included; 75 (EX_TEMPFAIL) worth trying
again later: the database is unreachable or stayed busy, no resource was free, a lock
was held; 141 the reader of stdout went away (`manage.py jobs list | head`), as a shell
reports a process that SIGPIPE ended.
"""
from __future__ import annotations

import argparse
import os
import pkgutil
import sys
from collections.abc import Iterator
from functools import partial
from importlib import import_module
from typing import Any, NoReturn

from django.apps import apps
from django.core.checks import Error as CheckError
from django.core.management.base import BaseCommand, CommandError, CommandParser, SystemCheckError
from django.db import Error, connections

from leases import db, routing

EX_USAGE = 2
EX_TEMPFAIL = 75
#: 128 + SIGPIPE: what a shell reports of a writer whose reader closed the pipe. Not 1,
#: which `jobs wait` and `pipeline wait` use for "it failed".
EX_PIPE = 141
DATABASE_HELP = "the database alias to use (default: where LEASES_ROUTES sends the name, else LEASES_DATABASE)"


def import_modules(modules: list[str]) -> None:
    """Import each `--import` module for the handlers and pipelines it defines; any
    error it raises (a syntax error too) is the operator's input, so one line, exit 2."""
    for module in modules:
        try:
            import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever the module raises is bad input
            raise CommandError(f"--import {module}: {db.one_line(exc)}", returncode=EX_USAGE) from None


def check_migrated(using: str | None = None) -> list[CheckError]:
    """An error when migrations of this package's installed apps are not applied to the
    database its engine uses (a missing table reads as a 60-line traceback otherwise).

    Checked by the commands themselves, not registered: `migrate` runs every registered
    check, so a registered one could never let it fix what it reports. One query of
    `django_migrations` and a listing of the migration files, cheap enough for every run."""
    alias = db.alias(using)
    files = {}
    for label in routing.APP_LABELS:
        if label in apps.app_configs:
            package = import_module(f"{apps.get_app_config(label).name}.migrations")
            files[label] = {name for _, name, is_pkg in pkgutil.iter_modules(package.__path__) if not is_pkg}
    connection = connections[alias]
    with connection.cursor() as cursor:  # an outage raises here, as it would anywhere
        applied = set()
        if "django_migrations" in connection.introspection.table_names(cursor):
            cursor.execute("SELECT app, name FROM django_migrations WHERE app IN (%s, %s, %s)", routing.APP_LABELS)
            applied = set(cursor.fetchall())
    pending = sorted(f"{label}.{name}" for label, names in files.items() for name in names
                     if (label, name) not in applied)
    if not pending:
        return []
    listed = ", ".join(pending[:3]) + (f" and {len(pending) - 3} more" if len(pending) > 3 else "")
    return [CheckError(f"database {alias!r} lacks migrations of django-leases ({listed}).",
                       hint=f"Run `python manage.py migrate --database {alias}`.", id="leases.E005")]


def one_line_error(parser: CommandParser, message: str) -> NoReturn:
    """argparse's refusal (a missing argument, an unknown choice, an option that is no
    number) as every other bad input: one line, exit 2, instead of the usage text and
    then the error. Called from code (call_command), a CommandError of exit code 2."""
    where = parser.prog.strip()  # call_command names no program: " jobs list"
    if not parser.called_from_command_line:
        raise CommandError(f"{where}: {message}", returncode=EX_USAGE)
    parser.exit(EX_USAGE, f"CommandError: {where}: {message} (see --help)\n")


def all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and, all the way down, its subcommands' parsers."""
    yield parser
    for action in parser._actions:  # argparse lists subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases name a parser twice
                yield from all_parsers(sub)


def stdout_closed() -> NoReturn:
    """End the command quietly once whoever read its output is gone (`| head`): the
    way Python's documentation gives, stdout pointed at devnull so the interpreter's
    last flush has somewhere to go, then exit EX_PIPE, without a traceback."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (a test's capture)
        pass
    raise SystemExit(EX_PIPE)


def add_database_option(*parsers: Any) -> None:
    """`--database ALIAS` on each parser (each subcommand's, so it goes after the action)."""
    for parser in parsers:
        parser.add_argument("--database", default=None, help=DATABASE_HELP)


class LeasesCommand(BaseCommand):
    """A command whose bad input exits 2 and whose database outage exits 75, each with one
    line on stderr instead of a traceback."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        """Django's parser, and its subcommands', with errors of one line."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        for one in all_parsers(parser):
            one.error = partial(one_line_error, one)  # type: ignore[method-assign]
        return parser

    def check(self, *args: Any, databases: list[str] | None = None, **kwargs: Any) -> None:
        """Django's checks, then that this app's tables are migrated: a clean error
        instead of a traceback ending in "Table ... doesn't exist". Django's checks touch
        no database here unless asked (from 6.1 they connect to every configured one,
        a refusal or an outage a traceback): the loop below connects to those this app
        uses, and says which refused."""
        try:
            super().check(*args, databases=databases or [], **kwargs)
        except SystemCheckError as exc:  # settings are the operator's input: exit 2, as any
            raise SystemCheckError(str(exc), returncode=EX_USAGE) from None
        for alias in routing.aliases():
            try:
                errors = check_migrated(alias)
            except Error as exc:
                if db.denied(exc):
                    raise CommandError(f"database {alias!r} refused the connection: {first_line(exc)}",
                                       returncode=EX_USAGE) from None
                if not db.transient(exc):
                    raise
                continue  # an outage: the command waits it out (or exits 75) on its own
            for error in errors:
                raise SystemCheckError(f"{error.msg} {error.hint} ({error.id})", returncode=EX_USAGE)

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            output = super().execute(*args, **options)
            self.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            return output
        except BrokenPipeError:
            stdout_closed()
        except ValueError as exc:
            raise CommandError(str(exc), returncode=EX_USAGE) from None
        except Error as exc:
            if db.denied(exc):
                raise CommandError(f"the database refused the connection: {first_line(exc)}",
                                   returncode=EX_USAGE) from None
            if not db.transient(exc):
                raise
            raise CommandError(f"database unavailable, try again later: {first_line(exc)}",
                               returncode=EX_TEMPFAIL) from None


def first_line(exc: BaseException) -> str:
    """An error's first line, its spaces folded (libpq indents what the server said); a
    MySQL error's message before its number, not the tuple of both."""
    args = getattr(exc, "args", ())
    if len(args) == 2 and isinstance(args[0], int) and isinstance(args[1], str):
        return f"{args[1]} ({args[0]})"
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__
