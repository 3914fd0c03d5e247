"""Headless Chromium for the admin's and dashboard's page tests: one snapshot of a page
(`snapshot`), or a page driven over the DevTools protocol on a pipe (`Browser`), with no
driver and no package.

With --remote-debugging-pipe Chromium reads commands from its fd 3 and writes answers to
its fd 4, each a JSON message ended by a NUL byte. That is all a test needs to open a
page, read its DOM with an expression, click, and wait for the page to change by itself
(which --dump-dom, one snapshot after the load, cannot show).
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import include, path

CHROMIUM = Path("/usr/bin/chromium")

#: Run in the child before Chromium: its pipes on fds 3 and 4, where it looks for them (a
#: preexec_fn would do the same in the forked test process, which runs threads).
PLACE_PIPES = (
    "import os, sys; reads, writes = map(int, sys.argv[1:3]); os.dup2(reads, 3); os.dup2(writes, 4);"
    " os.close(reads); os.close(writes); os.execv(sys.argv[3], sys.argv[3:])"
)
#: Flags of a quiet headless run.
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
    "--hide-scrollbars",
)


def needs_chromium() -> None:
    """Skip the test where Chromium is not installed (CI installs it)."""
    if not CHROMIUM.exists():
        pytest.skip("/usr/bin/chromium is missing (Debian: apt-get install chromium); .ci/run installs it")


def session_urls(landing: str, *more) -> list:
    """A test URLconf: /browser-session/KEY/ gives the browser the session the test client
    logged in with, then sends it to `landing`; then `more` and the project's URLs."""

    def hand_over(request: HttpRequest, key: str) -> HttpResponseRedirect:
        response = HttpResponseRedirect(landing)
        response.set_cookie(settings.SESSION_COOKIE_NAME, key, httponly=True)
        return response

    return [path("browser-session/<str:key>/", hand_over), *more, path("", include("project.urls"))]


def snapshot(profile: Path, *args: str) -> str:
    """Run headless Chromium once; its stdout (the DOM with --dump-dom)."""
    argv = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


class Browser:
    """One Chromium process and one page in it; close() ends the process."""

    def __init__(self, profile: Path, *flags: str) -> None:
        commands, self._to = os.pipe()
        self._from, answers = os.pipe()
        # Above 4, so that moving them to 3 and 4 in the child cannot overwrite one.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (commands, answers)]
        for fd in (commands, answers):
            os.close(fd)
        argv = [sys.executable, "-c", PLACE_PIPES, *map(str, high), str(CHROMIUM), *FLAGS,
                f"--user-data-dir={profile}", "--remote-debugging-pipe", *flags]
        self._log = open(profile.parent / "chromium.log", "wb")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(argv, pass_fds=high, stdout=self._log, stderr=subprocess.STDOUT)
        for fd in high:
            os.close(fd)
        self._buffer, self._last, self.session = b"", 0, ""

    def call(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        """Send a command (to the page once one is open) and return its result."""
        self._last += 1
        message: dict[str, Any] = {"id": self._last, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to, data):]
        deadline = time.monotonic() + timeout
        while True:
            answer = self._next(deadline)
            if answer.get("id") == self._last:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def _next(self, deadline: float) -> dict:
        """The next message (answers and events alike)."""
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium exited ({self.process.poll()}); see its log")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def open(self, url: str) -> None:
        """A new page, at `url`; later commands go to it."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20) -> None:
        """Wait until the expression is truthy in the page (TimeoutError after `timeout`
        seconds). An expression that throws is false: the page may be loading."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.evaluate(f"!!({expression})"):
                    return
            except RuntimeError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{expression} stayed false for {timeout} s")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError):
            pass  # it is killed below
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        for fd in (self._to, self._from):
            os.close(fd)
        self._log.close()
