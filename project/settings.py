"""Settings of the django-leases demo project.

Everything that differs between machines comes from the environment (django-environ):
``DATABASE_URL`` picks the database, SQLite in the checkout by default.
"""
from pathlib import Path

import environ

from leases.setup import database_settings

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, False),
    SECRET_KEY=(str, "django-insecure-demo-only-change-me"),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1"]),
)

SECRET_KEY = env("SECRET_KEY")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "leases",
    "leases.tasks",
    "leases.pipelines",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"


def _database(url: str) -> dict:
    """DATABASE_URL with what many processes sharing one database need (see
    leases.setup.database_settings); a relative SQLite file lives in the checkout."""
    db = database_settings(url)
    name = Path(db["NAME"])
    if db["ENGINE"].endswith("sqlite3") and not name.is_absolute() and str(name) != ":memory:":
        db["NAME"] = str(BASE_DIR / name)
        db["TEST"] = {"NAME": str((BASE_DIR / name).with_name("test_" + name.name))}
    return db


def _second(url: str) -> str:
    """DATABASE_URL with another database name: db.sqlite3 -> db-second.sqlite3, leases -> leases_second."""
    path, dot, ext = url.rpartition(".") if url.startswith("sqlite") else (url, "", "")
    return f"{path}-second.{ext}" if dot else f"{url}_second"


def second_database() -> dict:
    """The second database: DATABASE_URL_SECOND, else DATABASE_URL's with another name."""
    return _database(env("DATABASE_URL_SECOND", default=_second(_URL)))


_URL = env("DATABASE_URL", default="sqlite:///db.sqlite3")
# Which database each pool, lock, dispatcher and queue lives on, as JSON, e.g.
# LEASES_ROUTES='{"queues": {"crawl*": "second"}}' (see leases.routing).
LEASES_ROUTES = env.json("LEASES_ROUTES", default={})
DATABASES = {"default": _database(_URL)}
# A second database, for pools and queues spread over two, only when DATABASE_URL_SECOND names
# it or a route sends something there: Django 6.1's checks connect to every configured database.
_ROUTED = [alias for kind in (LEASES_ROUTES.values() if isinstance(LEASES_ROUTES, dict) else ())
           if isinstance(kind, dict) for alias in kind.values()]
if env.str("DATABASE_URL_SECOND", default="") or "second" in _ROUTED:
    DATABASES["second"] = second_database()

# Django's Tasks framework (django.tasks, or the django-tasks backport on Django 5.2) on
# the leases job queue: `manage.py leases_worker` runs these tasks beside native jobs.
TASKS = {
    "default": {
        "BACKEND": "leases.tasks.backend.DatabaseBackend",
        "QUEUES": ["default", "tasks"],
        "OPTIONS": {"max_attempts": 3, "backoff": 1.0},
    }
}

AUTH_PASSWORD_VALIDATORS = []

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"leases": {"handlers": ["console"], "level": env("LEASES_LOG_LEVEL", default="INFO")}},
}
