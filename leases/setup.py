"""Django for a process that has no Django project: a crawler pointed at the database.

A spider fleet should not need a settings module, `DJANGO_SETTINGS_MODULE` and
`manage.py migrate` to lease proxies. `configure(database_url=...)` sets Django up with
this app alone, and `create_tables()` (or `python -m leases.setup URL`) makes its tables.
`database_settings(url)` is also what a project's settings can use for DATABASES: it adds
the options that many processes sharing one database need.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

ENGINES = {
    "sqlite": "django.db.backends.sqlite3",
    "mysql": "django.db.backends.mysql",
    "mariadb": "django.db.backends.mysql",
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
}


def database_settings(url: str) -> dict[str, Any]:
    """A DATABASES entry for a URL: `sqlite:///relative.sqlite3`, `sqlite:////absolute`,
    `mysql://user:password@host:3306/name?option=value` (or `mariadb://`),
    `postgres://user:password@host:5432/name` (or several `host:port` pairs, comma-separated:
    libpq tries them in turn, `?target_session_attrs=read-write` picks the one taking writes).
    `?read_timeout=` is the engine's read deadline on PostgreSQL (seconds, or `none`), the
    driver's on MySQL. ValueError, one line, for anything else."""
    parts = urlsplit(url)
    engine = ENGINES.get(parts.scheme)
    if engine is None:
        raise ValueError(f"database URL {_shown(url)!r}: the scheme must be one of {', '.join(ENGINES)}")
    options: dict[str, Any] = {key: _number(value) for key, value in parse_qsl(parts.query)}
    if parts.scheme == "sqlite":
        return _sqlite(unquote(parts.path[1:]) or ":memory:", options)
    if not parts.path.strip("/"):
        raise ValueError(f"database URL {_shown(url)!r} names no database (…/name)")
    if engine.endswith("postgresql"):
        return _postgres(parts, options)
    # A server that stalls or vanishes must surface as an error the engine retries, not
    # hang a heartbeat forever; lock waits end well before that.
    options.setdefault("charset", "utf8mb4")
    options.setdefault("connect_timeout", 5)
    options.setdefault("read_timeout", 30)
    options.setdefault("write_timeout", 30)
    options.setdefault("init_command", "SET SESSION innodb_lock_wait_timeout = 10")
    return {
        "ENGINE": engine, "NAME": unquote(parts.path.strip("/")), "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""), "HOST": parts.hostname or "", "PORT": str(parts.port or ""),
        "OPTIONS": options, "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
    }


def _postgres(parts: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A link that vanished becomes an error within seconds (libpq's connect timeout, TCP
    keepalives and user timeout), and lock waits end after ten. libpq has no read timeout
    and a stopped server's kernel still acknowledges, so none of those fires while the
    server stalls: the engine's own read deadline, LEASES_READ_TIMEOUT, ends that wait."""
    timeout = {"LEASES_READ_TIMEOUT": _seconds(options.pop("read_timeout"))} if "read_timeout" in options else {}
    options.setdefault("connect_timeout", 5)
    options.setdefault("keepalives", 1)
    options.setdefault("keepalives_idle", 10)
    options.setdefault("keepalives_interval", 5)
    options.setdefault("keepalives_count", 3)
    options.setdefault("tcp_user_timeout", 30_000)
    options.setdefault("options", "-c lock_timeout=10s")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    pairs = [_host_port(pair, parts) for pair in hosts.split(",")]
    return {
        "ENGINE": ENGINES["postgres"], "NAME": unquote(parts.path.strip("/")), "USER": unquote(user),
        "PASSWORD": unquote(password), "HOST": ",".join(host for host, _ in pairs),
        "PORT": ",".join(port for _, port in pairs) if any(port for _, port in pairs) else "",
        "OPTIONS": options, **timeout,
    }


def _seconds(value: Any) -> Any:
    """A URL's number of seconds, `none` as None; anything else as given, for the check to name."""
    if str(value).lower() == "none":
        return None
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _host_port(pair: str, parts: Any) -> tuple[str, str]:
    """One `host[:port]` of a PostgreSQL URL (an IPv6 address in brackets)."""
    host, port = (pair[1:].split("]", 1) if pair.startswith("[") else ("", pair))
    if not host:
        host, _, port = pair.rpartition(":") if ":" in pair else (pair, "", "")
    port = port.lstrip(":")
    if port and not port.isdecimal():
        raise ValueError(f"database URL {_shown(parts.geturl())!r}: port {port!r} is not a number")
    return unquote(host).lower(), port


def _sqlite(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A file, not memory, so that processes share it; WAL lets readers run beside the
    one writer, and a long busy timeout rides out bursts of writes."""
    options.setdefault("timeout", 30)
    options.setdefault("init_command", "PRAGMA journal_mode=WAL;PRAGMA synchronous=NORMAL")
    entry: dict[str, Any] = {"ENGINE": ENGINES["sqlite"], "NAME": name, "OPTIONS": options}
    if name != ":memory:":
        path = Path(name)
        entry["TEST"] = {"NAME": str(path.with_name("test_" + path.name))}
    return entry


def _number(value: str) -> Any:
    return int(value) if value.isdecimal() and value.isascii() else value


def _shown(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def configure(database_url: str, **settings: Any) -> None:
    """Set Django up for this process with the leases app and `database_url` as its
    database; `settings` are added (INSTALLED_APPS to add `leases.tasks`, LOGGING, any
    LEASES_* setting). A process that is a Django project (its settings configured, or
    named by DJANGO_SETTINGS_MODULE) keeps its own settings: they are only loaded."""
    import django
    from django.apps import apps
    from django.conf import settings as django_settings

    if django_settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE"):
        if not apps.ready:
            django.setup()
        return
    django_settings.configure(**{
        "DATABASES": {"default": database_settings(database_url)},
        "INSTALLED_APPS": ["leases"],
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
        **settings,
    })
    django.setup()


def create_tables(using: str = "default") -> None:
    """Make (or bring up to date) the tables of the installed apps: `manage.py migrate`
    for a process without manage.py. Run it once, as a deploy step, rather than from
    every crawler process at the same moment: two migrations at once can collide."""
    from django.core.management import call_command

    call_command("migrate", database=using, interactive=False, verbosity=0)


def configured_from(url: str) -> bool:
    """`configure(url)` for a command line: False, after one line on stderr, for a bad URL
    or one whose driver is not installed."""
    from django.core.exceptions import ImproperlyConfigured

    try:
        configure(url)
    except (ValueError, ImproperlyConfigured) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return False
    return True


def main(argv: list[str]) -> int:
    """`python -m leases.setup DATABASE_URL`: create the tables; exit 2 on a bad URL, 75
    (EX_TEMPFAIL) when the database cannot be reached or refuses us."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m leases.setup DATABASE_URL  (creates the tables of django-leases)", file=sys.stderr)
        return 2
    if not configured_from(argv[0]):
        return 2
    from django.db import Error

    try:
        create_tables()
    except Error as exc:  # an outage or a refusal: one line, as the commands say it
        print(f"error: {_shown(argv[0])}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 75
    print(f"tables of django-leases ready in {_shown(argv[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
