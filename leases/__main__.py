"""`python -m leases DATABASE_URL COMMAND [ARGS]`: this app's operators' commands (`lease
list`, `lease quarantine`, `lease release`, ...) for a crawler fleet that has no Django
project, on the database its crawlers use (see `leases.setup.configure`). A project runs
the same commands as `manage.py lease ...`."""
from __future__ import annotations

import sys

from .setup import configured_from

#: Commands of the companion apps, which a host without a project does not have.
PROJECT_ONLY = "`jobs`, `schedule`, `dispatch`, `pipeline`, `leases_worker` and `leases_prune`"
USAGE = "usage: python -m leases DATABASE_URL COMMAND [ARGS]  (e.g. python -m leases sqlite:////srv/leases.sqlite3 lease list)"


def main(argv: list[str]) -> int:
    """Run the command on the database of the URL; exit 2 on a missing command or a bad
    URL, else the command's own exit code."""
    if len(argv) < 2 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    if not configured_from(argv[0]):
        return 2
    from django.core.management import execute_from_command_line, get_commands

    if argv[1] not in get_commands() and argv[1] not in ("help", "--help", "-h", "--version"):
        print(f"python -m leases: no command {argv[1]!r} here. Without a Django project it runs the leases app's"
              f" `lease` (and Django's own, such as `migrate`); {PROJECT_ONLY} need a Django project with"
              " leases.tasks installed (see the install docs)", file=sys.stderr)
        return 2

    try:
        execute_from_command_line(["python -m leases", *argv[1:]])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
