"""The command line: the options, their checks, and `main`."""

from __future__ import annotations

import argparse
import math
import os
import sys

from .kills import kill_window, min_seconds
from .run import Demo

POOL = "demo-proxies"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m project.demo",
        description="Crawler processes share a pool of proxies through django-leases; "
        "some are SIGKILLed and their proxies come back after the ttl.",
    )
    p.add_argument("--proxies", type=int, default=40, help="proxies in the pool (default 40)")
    p.add_argument("--crawlers", type=int, default=60, help="crawler processes (default 60)")
    p.add_argument(
        "--kills", type=int, default=5, help="crawlers to SIGKILL while they hold a proxy (default 5)"
    )
    p.add_argument("--seconds", type=float, default=30, help="how long the crawlers run (default 30)")
    p.add_argument("--ttl", type=float, default=3, help="lease ttl in seconds (default 3)")
    p.add_argument("--interval", type=float, default=None, help="renewal interval (default ttl/3)")
    p.add_argument("--pool", default=POOL, help=f"pool name (default {POOL})")
    p.add_argument(
        "--plain", action="store_true", help="status lines instead of the live table, even on a terminal"
    )
    opts = p.parse_args(argv)
    if opts.interval is None:
        opts.interval = opts.ttl / 3
    check_options(p, opts)
    return opts


def check_options(p: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Exit with usage and an error (status 2) on options the demo cannot run with."""
    if opts.proxies < 1 or opts.proxies > 9999:
        p.error("--proxies must be between 1 and 9999")
    if opts.crawlers < 1:
        p.error("--crawlers must be at least 1")
    if not 0 <= opts.kills <= opts.crawlers:
        p.error("--kills must be between 0 and --crawlers")
    if opts.ttl <= 0 or not 0 < opts.interval < opts.ttl:
        p.error("--ttl must be > 0 and --interval between 0 and the ttl")
    if opts.seconds <= 0:
        p.error("--seconds must be > 0")
    if opts.kills and kill_window(opts)[1] < kill_window(opts)[0]:
        p.error(
            f"--seconds is too short for kills with ttl {opts.ttl:g}: "
            f"use at least {math.ceil(min_seconds(opts))}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the demo on project.settings' database (unless DJANGO_SETTINGS_MODULE says otherwise).

    Returns the exit code: 0 OK, 1 FAILED, 2 without the leases table, 130 interrupted.
    """
    opts = parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.db import connection

    if "leases_resource" not in connection.introspection.table_names():
        print("the leases table is missing: run `python manage.py migrate` first", file=sys.stderr)
        return 2
    return Demo(opts).run()
