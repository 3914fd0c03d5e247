"""A mistake in the settings is a system check error with an id of its own at `manage.py
check` (which exits non-zero), saying what to change: never a traceback, and never an
error at the first push or enqueue."""
from __future__ import annotations

import subprocess
import textwrap
from importlib.util import find_spec

import pytest
from django.core.checks import run_checks

from leases import conf

# Django 6.1's model checks ask every configured database what it supports (JSONField).
pytestmark = pytest.mark.django_db(databases=["default", "second"])


def ids() -> set[str]:
    return {message.id for message in run_checks() if message.id.startswith("leases.")}


@pytest.mark.parametrize("setting, value, code", [
    ("LEASES_MAX_JSON_BYTES", "big", "leases.E007"),
    ("LEASES_MAX_JSON_BYTES", 10, "leases.E007"),
    ("LEASES_KEEP_RUNS", 0, "leases.E008"),
    ("LEASES_HANDLER_GRACE", "ten minutes", "leases.E009"),
    ("LEASES_SCHEDULES", {"nightly": {"handler": "noop"}}, "leases.E010"),
    ("LEASES_SCHEDULES", {"nightly": {"handler": "noop", "evry": 60}}, "leases.E010"),
    ("LEASES_SCHEDULES", ["nightly"], "leases.E010"),
    ("LEASES_METRICS_TOKEN", 1234, "leases.E011"),
    ("LEASES_DATABASE", "nowhere", "leases.E002"),
])
def test_each_bad_leases_setting_is_its_own_check_error(settings, setting, value, code):
    assert code not in ids()
    setattr(settings, setting, value)
    found = [m for m in run_checks() if m.id == code]
    assert len(found) == 1 and setting in found[0].msg and "\n" not in found[0].msg


@pytest.mark.parametrize("entry, words", [
    ({"BACKEND": "leases.tasks.backends.DatabaseBackend"}, "cannot be imported"),
    ({"BACKEND": "leases.task.backend.DatabaseBackend"}, "cannot be imported"),
])
def test_a_misspelt_tasks_backend_is_a_check_error_naming_the_right_path(settings, entry, words):
    settings.TASKS = {**settings.TASKS, "typo": entry}
    found = [m for m in run_checks() if m.id == "leases.E013"]
    assert len(found) == 1 and words in found[0].msg and conf.TASKS_BACKEND in found[0].hint


@pytest.mark.parametrize("options, words", [
    ({"max_attempts": 0}, "max_attempts"),
    ({"backoff": "soon"}, "backoff"),
    ({"retries": 3}, "unknown option(s) retries"),
    ({"database": "nowhere"}, "'nowhere' is not in DATABASES"),
])
def test_bad_options_of_this_tasks_backend_are_a_check_error(settings, options, words):
    settings.TASKS = {"default": {"BACKEND": conf.TASKS_BACKEND, "QUEUES": ["default"], "OPTIONS": options}}
    found = [m for m in run_checks() if m.id == "leases.E012"]
    assert len(found) == 1 and words in found[0].msg


def test_the_demo_settings_pass():
    assert not [m for m in run_checks() if m.id.startswith("leases.E")]


def check(tmp_path, child_env, manage, body: str) -> subprocess.CompletedProcess:
    """`manage.py check` with the demo settings changed by `body`."""
    (tmp_path / "changed_settings.py").write_text("from project.settings import *  # noqa\n" + textwrap.dedent(body))
    env = {**child_env, "DJANGO_SETTINGS_MODULE": "changed_settings",
           "PYTHONPATH": f"{tmp_path}:{child_env['PYTHONPATH']}"}
    return subprocess.run([*manage, "check"], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("body, code", [
    ('TASKS = {"default": {"BACKEND": "leases.tasks.backends.DatabaseBackend"}}\n', "leases.E013"),
    ('TASKS = {"default": {"BACKEND": "leases.tasks.backend.DatabaseBackend", "OPTIONS": {"retries": 3}}}\n',
     "leases.E012"),
    # The backport's app adds the Tasks framework's own check, which builds every backend.
    pytest.param('INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks"]\n'
                 'TASKS = {"default": {"BACKEND": "leases.tasks.backend.DatabaseBackend", "OPTIONS": {"backoff": "x"}},'
                 ' "typo": {"BACKEND": "leases.task.backend.DatabaseBackend"}}\n', "leases.E013",
                 marks=pytest.mark.skipif(not find_spec("django_tasks"), reason="Django 6: no backport")),
    ('LEASES_MAX_JSON_BYTES = "big"\n', "leases.E007"),
    ('INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "leases.tasks"]\n', "leases.E015"),
    # With the demo's URLconf, which imports the base app's admin and URLs.
    ('INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "leases"]\n', "leases.E014"),
    ('INSTALLED_APPS = [app for app in INSTALLED_APPS if app not in ("leases", "leases.pipelines")]\n',
     "leases.E014"),
])
def test_manage_py_check_exits_non_zero_with_the_id_and_no_traceback(tmp_path, child_env, manage, body, code):
    done = check(tmp_path, child_env, manage, body)
    assert done.returncode != 0 and f"({code})" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
