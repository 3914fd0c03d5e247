"""The quickstart page runs as written: a fresh Django project is built in a temporary
folder from the very blocks docs/quickstart.md shows, with this checkout's .venv and the
checkout on PYTHONPATH (nothing is installed), and what it prints is what the page says.

The test holds no copy of the steps. Each fenced block's info string says what to do
with it (GitHub and Sphinx ignore everything after the language):

- ``sh run``: run with bash in the project's folder, in page order;
- ``text output``: what the ``sh run`` block before it prints (doctest's ELLIPSIS and
  NORMALIZE_WHITESPACE: ``...`` is any text);
- ``python file=PATH`` / ``python append=PATH``: write or extend that file;
- ``pycon``: a doctest, run in a process of its own with the project's settings;
- ``sh``: shown, not run (the ``pip install``, which this test replaces with PYTHONPATH);
- ``python``: shown, not run (settings for other databases than the test's SQLite).
"""
from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "quickstart.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
#: What the blocks' info strings may say; anything else (a typo) fails the test.
KINDS = re.compile(r"sh|sh run|text output|pycon|python|python (file|append)=\S+")
#: Runs a pycon block, read from stdin, as a doctest with the project's settings.
DOCTEST = """
import doctest, sys
import django
django.setup()
test = doctest.DocTestParser().get_doctest(sys.stdin.read(), {}, "quickstart", "docs/quickstart.md", 0)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
runner.run(test)
sys.exit(1 if runner.failures else 0)
"""


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block of the page, in order."""
    return [(info.strip(), body) for info, body in FENCE.findall(text)]


def project_env() -> dict[str, str]:
    """The environment of a newcomer's shell: this .venv first on PATH, the checkout on
    PYTHONPATH, and none of the test run's Django settings or databases."""
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL",
                                                            "DATABASE_URL_SECOND", "LEASES_ROUTES")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def matches(want: str, got: str) -> bool:
    checker = doctest.OutputChecker()
    return checker.check_output(want, got, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)


def test_the_page_tags_every_block_with_what_to_do():
    found = blocks(PAGE.read_text(encoding="utf-8"))
    unknown = [info for info, _ in found if not KINDS.fullmatch(info)]
    assert not unknown, f"blocks of {PAGE.name} with an info string the test does not know: {unknown}"
    kinds = [info.split("=")[0] for info, _ in found]
    # The steps the page promises: make, configure, migrate, push, work, read, lease, lock.
    assert kinds.count("sh run") >= 4 and kinds.count("pycon") >= 3 and kinds.count("text output") >= 2
    assert "python file" in kinds and "python append" in kinds


def test_the_quickstart_runs_as_written_in_a_fresh_project(tmp_path):
    env = project_env()
    output = None
    ran = []
    for info, body in blocks(PAGE.read_text(encoding="utf-8")):
        if info == "sh run":
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
            assert done.returncode == 0, f"$ {body}\n{done.stdout}"
            output = done.stdout
        elif info == "text output":
            assert output is not None, "a text output block follows no sh run block"
            assert matches(body, output), f"the page says:\n{body}\nbut it printed:\n{output}"
            output = None
        elif info.startswith("python "):
            how, path = info.split(" ", 1)[1].split("=", 1)
            target = tmp_path / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if how == "append":
                assert target.exists(), f"{path} should exist by now (the page appends to it)"
                with target.open("a", encoding="utf-8") as file:
                    file.write("\n" + body)
            else:
                target.write_text(body, encoding="utf-8")
        elif info == "pycon":
            done = subprocess.run([sys.executable, "-c", DOCTEST], input=body, cwd=tmp_path,
                                  env={**env, "DJANGO_SETTINGS_MODULE": "mysite.settings"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
            assert done.returncode == 0, f"the page's session:\n{body}\nran so:\n{done.stdout}"
        ran.append(info)
    assert "pycon" in ran and "sh run" in ran
