"""Helpers the tests of several folders share: reading an admin page's table, the lines
handlers log, a child process that reports on stdout and takes commands on stdin, how
long a pushed job waited for a worker, and the end of a drain by worker processes."""
from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import threading
from collections import Counter
from html.parser import HTMLParser
from typing import Any


class Rows(HTMLParser):
    """Cells of the changelist table: {column: text, column.title: hover text} per row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.column: str | None = None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "tr":
            self.rows.append({})
        elif tag in ("td", "th") and self.rows:
            self.column = next((c[6:] for c in classes if c.startswith("field-")), None)
            if self.column:
                self.rows[-1][self.column] = ""
        elif self.column and dict(attrs).get("title"):
            self.rows[-1][self.column + ".title"] = dict(attrs)["title"]

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.column = None

    def handle_data(self, data):
        if self.column:
            self.rows[-1][self.column] += data


def table(response, *key: str) -> dict:
    """Changelist rows keyed by the text of the `key` columns: {key: {column: text}}."""
    assert response.status_code == 200
    html = response.content.decode()
    start = html.find('id="result_list"')
    parser = Rows()
    if start >= 0:
        parser.feed(html[start : html.index("</table>", start)])
    found = [{k: v.strip() for k, v in row.items()} for row in parser.rows if key[0] in row]
    return {row[key[0]] if len(key) == 1 else tuple(row[k] for k in key): row for row in found}


def listed(client, url: str, **params) -> tuple[int, int | None]:
    """A changelist's status and, for a page, how many rows it lists: what a user of the
    admin learns from a search or a filter."""
    response = client.get(url, params)
    if response.status_code != 200:
        return response.status_code, None
    html = response.content.decode()
    start = html.find('id="result_list"')
    parser = Rows()
    if start >= 0:
        parser.feed(html[start : html.index("</table>", start)])
    return 200, len([row for row in parser.rows if row])


def staff(client, *codenames: str) -> Any:
    """A staff user with these permissions only, logged in on `client`."""
    from django.contrib.auth.models import Permission, User

    found = User.objects.create_user("-".join(codenames), password="pw", is_staff=True)
    found.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client.force_login(found)
    return found


def log_lines(path) -> list[tuple[int, int]]:
    """(n, pid) per handler run recorded in `path`."""
    if not path.exists():
        return []
    return [tuple(int(part) for part in line.split()) for line in path.read_text().splitlines()]


class Child:
    """A child that reports JSON lines on stdout and takes commands on stdin; its log
    (stderr) is collected for the end."""

    def __init__(self, argv: list[str], env: dict) -> None:
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(argv, env=env, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
        self.events: queue.Queue[str] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.events.put), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.lines.append), daemon=True).start()

    @staticmethod
    def _drain(stream, put) -> None:
        for line in stream:
            put(line)

    def next(self, timeout: float) -> dict:
        try:
            return json.loads(self.events.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no report within {timeout}s; log so far:\n{self.log()}") from None

    def ask(self, command: str, timeout: float = 10) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.next(timeout)

    def log(self) -> str:
        return "".join(self.lines)


def pickup_seconds(job_id: int, timeout: float = 20) -> float:
    """Seconds from the job's push to its claim, both read off the database's clock, once
    a worker has started it."""
    from leases.tasks.models import Job
    from tests.conftest import wait_for

    job = wait_for(lambda: Job.objects.filter(pk=job_id, started_at__isnull=False).first(), timeout,
                   "the job to start")
    return (job.started_at - job.enqueued_at).total_seconds()


def drain_and_check(workers, procs, log, total: int, timeout: float = 120) -> Counter:
    """Wait until every job succeeded; stop the workers gracefully (`workers`: the
    `Workers` that started `procs`); check that none died and nothing was left behind.
    Returns the runs per job."""
    from leases.tasks.models import Job
    from tests.conftest import wait_for

    wait_for(lambda: Job.objects.filter(status=Job.SUCCEEDED).count() == total, timeout, f"{total} jobs succeeded")
    for proc in procs:
        assert proc.poll() is None, f"worker {proc.pid} died:\n{workers.stderr(proc)}"
        os.kill(proc.pid, signal.SIGTERM)
    for proc in procs:
        assert workers.wait(proc, 60) == 0, workers.stderr(proc)
        assert "Traceback" not in workers.stderr(proc), workers.stderr(proc)
    assert not Job.objects.filter(status__in=[Job.READY, Job.RUNNING]).exists()
    runs = Counter(n for n, _ in log_lines(log))
    assert set(runs) == set(range(total))
    return runs


def jobs_command(*args: str) -> str:
    """`manage.py jobs ...` in this process: what it printed."""
    from django.core.management import call_command

    out = io.StringIO()
    call_command("jobs", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def jobs_command_fails(*args: str, code: int = 2) -> str:
    """`manage.py jobs ...` that must fail with exit `code` and one line: that line."""
    import pytest
    from django.core.management import CommandError

    with pytest.raises(CommandError) as info:
        jobs_command(*args)
    assert info.value.returncode == code and "\n" not in str(info.value)
    return str(info.value)
