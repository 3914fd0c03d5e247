"""`manage.py lease`: operator subcommands in process, `lease run` as a real subprocess."""
from __future__ import annotations

import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import OutputWrapper

from leases import Pool
from leases.clock import db_now
from leases.management.commands import lease as lease_command
from leases.management.lines import MAX_LINE, entries
from leases.models import Resource
from leases.progress import progress_bar
from tests.conftest import alive, start_lease_run

POOL = "proxies"


@pytest.fixture
def pool():
    p = Pool(POOL)
    p.add("r1", data={"url": "http://r1"})
    p.add("r2")
    return p


def lease(*args: str) -> tuple[str, str]:
    """Run `lease ARGS` in process; its stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    call_command("lease", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def snapshot() -> list:
    return list(Resource.objects.order_by("pool", "name").values())


def row(name: str, pool: str = POOL) -> Resource:
    return Resource.objects.get(pool=pool, name=name)


def wait_for(path: Path, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, f"{path} not written within {timeout}s"
        time.sleep(0.05)
    return path.read_text()


# -- progress bar -----------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_off_when_not_a_terminal():
    stream = io.StringIO()
    with progress_bar(10, "loading", stream) as bar:
        bar.update(4)
        bar.update(6)
    assert stream.getvalue() == ""


def test_progress_draws_on_a_terminal_even_through_django_output():
    terminal = Terminal()
    with progress_bar(10, "loading", OutputWrapper(terminal)) as bar:
        bar.update(4)
        bar.update(6)
    drawn = terminal.getvalue()
    assert drawn.startswith("\rloading:   0%") and "10/10" in drawn and drawn.endswith("\n")


# -- operator subcommands ---------------------------------------------------------------


@pytest.mark.django_db
def test_add_is_idempotent_and_sets_data(pool):
    assert lease("add", POOL, "r3")[0] == "added proxies/r3\n"
    assert lease("add", POOL, "r3")[0] == "already there: proxies/r3\n"
    lease("add", POOL, "r3", "--data", '{"url": "http://r3", "n": [1, 2]}')
    assert row("r3").data == {"url": "http://r3", "n": [1, 2]}
    assert Resource.objects.filter(pool=POOL).count() == 3


@pytest.mark.django_db
def test_import_reads_names_and_csv_with_json_and_is_idempotent(tmp_path):
    file = tmp_path / "proxies.csv"
    file.write_text('# proxies\na\n\nb,{"url": "http://b", "ports": [1, 2]}\n  c ,  \n')
    out, err = lease("import", POOL, str(file))
    assert out == "3 added to proxies (0 already there)\n"
    assert err == ""  # no bar into a file or a pipe
    assert {r.name: r.data for r in Pool(POOL).resources()} == {
        "a": {},
        "b": {"url": "http://b", "ports": [1, 2]},
        "c": {},
    }
    assert lease("import", POOL, str(file))[0] == "0 added to proxies (3 already there)\n"


@pytest.mark.django_db
def test_list_shows_state_holder_and_expiry_by_the_database_clock(pool, monkeypatch):
    held = pool.acquire(ttl=100)
    pool.quarantine("r1" if held.name == "r2" else "r2", seconds=600, reason="banned")
    # Pretend the server's clock is 50 s behind ours: expiry must follow the server.
    server = db_now() - timedelta(seconds=50)
    monkeypatch.setattr(lease_command, "db_now", lambda using=None: server)
    out = lease("list", POOL)[0]
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["NAME", "SLOT", "USED", "STATE", "HOLDER", "EXPIRES", "TOKEN", "QUARANTINE"]
    by_name = {line[0]: [line[0], *line[3:]] for line in lines[1:]}  # as before the slot columns
    assert [line[1:3] for line in lines[1:]] == [["0", "1/1" if held.name == "r1" else "0/1"],
                                                  ["0", "1/1" if held.name == "r2" else "0/1"]]
    # A time left as every command and the admin say one: in its largest whole unit.
    assert by_name[held.name][1:5] == ["held", held.holder, "in", "2m"]  # 140 to 150 s by the server
    other = by_name["r1" if held.name == "r2" else "r2"]
    # Nobody holds it: no EXPIRES beside its quarantine, which says until when (640 to 650 s).
    until = row(other[0]).quarantined_until
    assert other[1:] == ["quarantined", "1", "until", f"{until:%Y-%m-%d}", f"{until:%H:%M:%S}Z", "(in", "10m):",
                         "banned"]


@pytest.mark.django_db
def test_list_without_a_pool_shows_every_pool(pool):
    Pool("accounts").add("alice")
    lines = [line.split() for line in lease("list")[0].splitlines()]
    assert lines[0][:2] == ["POOL", "NAME"]
    assert [line[:5] for line in lines[1:]] == [
        ["accounts", "alice", "0", "0/1", "free"],
        ["proxies", "r1", "0", "0/1", "free"],
        ["proxies", "r2", "0", "0/1", "free"],
    ]


@pytest.mark.django_db
def test_list_of_no_resources_says_so():
    assert lease("list") == ("no resources\n", "")


@pytest.mark.django_db
def test_remove_release_quarantine_unquarantine_and_stats(pool):
    assert lease("remove", POOL, "r2")[0] == "removed proxies/r2\n"
    assert not Resource.objects.filter(name="r2").exists()

    pool.acquire(ttl=60)
    assert lease("release", POOL, "r1")[0] == "released proxies/r1\n"
    assert row("r1").state_at(db_now()) == Resource.FREE
    assert lease("release", POOL, "r1")[0] == "proxies/r1 was not held\n"

    assert lease("quarantine", POOL, "r1", "--for", "10m", "--reason", "banned")[0] == (
        "quarantined proxies/r1 for 10m00s\n"
    )
    r1 = row("r1")
    assert r1.quarantine_reason == "banned"
    assert 590 < (r1.quarantined_until - db_now()).total_seconds() <= 600
    assert json.loads(lease("stats", POOL)[0]) == {"free": 0, "held": 0, "cooling": 0, "quarantined": 1, "total": 1}

    assert lease("unquarantine", POOL, "r1")[0] == "proxies/r1 is back in service\n"
    assert lease("unquarantine", POOL, "r1")[0] == "proxies/r1 was not quarantined\n"
    assert json.loads(lease("stats", POOL)[0]) == {"free": 1, "held": 0, "cooling": 0, "quarantined": 0, "total": 1}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, message",
    [
        (["add", POOL, "r3", "--data", "{bad"], "--data is not valid JSON"),
        (["add", POOL, "n" * 256], "resource name is longer than 255"),
        (["add", "p" * 101, "r3"], "pool name is longer than 100"),
        (["remove", POOL, "nope"], "no resource 'nope' in pool 'proxies'"),
        (["release", POOL, "nope"], "no resource 'nope'"),
        (["quarantine", POOL, "r1", "--for", "soon"], "--for: not a duration: 'soon'"),
        (["quarantine", POOL, "r1", "--for", "0"], "--for: duration must be > 0"),
        (["quarantine", POOL, "nope"], "no resource 'nope'"),
        (["unquarantine", POOL, "nope"], "no resource 'nope'"),
        (["list", ""], "pool name must be a non-empty string"),
        (["list", "nope"], "pool 'nope' has no resources (known pools: proxies)"),
        (["stats", "nope"], "pool 'nope' has no resources"),
        (["import", POOL, "/nonexistent/resources.csv"], "cannot read /nonexistent/resources.csv"),
        (["run", "nope", "--", "true"], "pool 'nope' has no resources"),
        (["run", POOL, "--ttl", "0", "--", "true"], "--ttl: duration must be > 0: '0'"),
        (["run", POOL, "--ttl", "1x", "--", "true"], "--ttl: not a duration: '1x' (use e.g. 90s, 10m, 2h, 1d)"),
        (["run", POOL, "--ttl", "0.05", "--", "true"], "ttl must be at least 0.1 seconds"),
        (["run", POOL, "--wait", "-1", "--", "true"], "--wait: duration must be >= 0: '-1'"),
        (["run", POOL, "--grace", "-1", "--", "true"], "--grace: duration must be >= 0: '-1'"),
        (["run", POOL], "no command given"),
        (["add", POOL, "r3", "--data", "[" * 100_000 + "]" * 100_000], "--data is nested too deeply"),
        (["add", POOL, "r3", "--data", "[" * 40 + "]" * 40], "data is nested deeper than 31 levels"),
        (["run", POOL, "--ttl", "4e8", "--", "true"], "--ttl: duration '4e8' must be at most 3.1536e+08 seconds"),
        (["run", POOL, "--wait", "4000d", "--", "true"], "--wait: duration '4000d' must be at most 3.1536e+08"),
        (["run", POOL, "--grace", "4e8", "--", "true"], "--grace: duration '4e8' must be at most 3.1536e+08"),
        (["quarantine", POOL, "r1", "--for", "4000d"], "duration '4000d' must be at most 3.1536e+08 seconds"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(pool, args, message):
    before = snapshot()
    with pytest.raises(CommandError) as caught:
        lease(*args)
    assert caught.value.returncode == 2
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert snapshot() == before


@pytest.mark.django_db(transaction=True)
def test_import_with_a_bad_line_adds_nothing_and_names_the_line(pool, tmp_path, child_env, manage):
    file = tmp_path / "proxies.csv"
    file.write_text('new1\nnew2,{"ok": 1}\nnew3,{"broken": \nnew4\n')
    before = snapshot()
    argv = [*manage, "lease", "import", POOL, str(file)]
    done = subprocess.run(argv, env=child_env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and ", line 3: " in done.stderr
    assert snapshot() == before


@pytest.mark.django_db
def test_import_drops_a_byte_order_mark_and_takes_crlf_lines(tmp_path):
    file = tmp_path / "proxies.csv"
    file.write_bytes('\ufeffa\r\nb,{"url": "http://b"}\r\n'.encode())
    assert lease("import", POOL, str(file))[0] == "2 added to proxies (0 already there)\n"
    assert {r.name: r.data for r in Pool(POOL).resources()} == {"a": {}, "b": {"url": "http://b"}}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "content, message",
    [
        (b"a\nb\n" + b"c" * (MAX_LINE + 1) + b"\nd\n", "line 3: longer than 65536 bytes"),
        (b"a\n" + b"x" * 10 * MAX_LINE, "line 2: longer than 65536 bytes"),
        (b"a\nb\xff\n", "line 2: not UTF-8 text"),
        (b"a\n\xef\xbb\xbfb\n", "line 2: resource name must not contain control or invisible characters"),
        (b"a,{}\nb," + b"[" * 20_000 + b"]" * 20_000 + b"\n", "line 2: data is nested too deeply"),
    ],
    ids=["long line", "no line breaks", "not utf-8", "bom inside", "deep json"],
)
def test_import_of_a_bad_file_exits_2_with_one_line_and_writes_nothing(pool, tmp_path, content, message):
    file = tmp_path / "bad.csv"
    file.write_bytes(content)
    before = snapshot()
    with pytest.raises(CommandError) as caught:
        lease("import", POOL, str(file))
    assert caught.value.returncode == 2
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert snapshot() == before


def test_entries_streams_lines_up_to_the_bound(tmp_path):
    file = tmp_path / "lines.txt"
    file.write_bytes(b"\xef\xbb\xbf# comment\n\n  one  \r\n" + b"x" * MAX_LINE + b"\r\nlast")
    assert [(n, len(line)) for n, line in entries(str(file))] == [(3, 3), (4, MAX_LINE), (5, 4)]


@pytest.mark.django_db(transaction=True)
def test_import_of_an_endless_file_fails_fast_in_little_memory(pool, child_env, manage):
    limit = 1 << 30  # address space: reading /dev/zero whole would blow through it

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    before = snapshot()
    argv = [*manage, "lease", "import", POOL, "/dev/zero"]
    done = subprocess.run(
        argv, env=child_env, capture_output=True, text=True, timeout=60, preexec_fn=cap_memory, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == "CommandError: /dev/zero, line 1: longer than 65536 bytes\n"
    assert snapshot() == before


@pytest.mark.django_db
def test_list_escapes_control_and_invisible_characters(pool):
    later = db_now() + timedelta(hours=1)
    # Rows the ORM wrote without the checks names get on the way in.
    Resource.objects.create(pool=POOL, name="evil\x1b[2J\nname\u202e", holder="h\x07:1:ab", busy_before=later)
    Resource.objects.create(
        pool="p\x1b]0;title\x07", name="q\u200b", quarantined_until=later, busy_before=later,
        quarantine_reason="banned\r\n\x1b[31mred",
    )
    out = lease("list")[0]
    assert not any(c in out for c in "\x1b\x07\r\u202e\u200b")
    lines = out.splitlines()
    assert len(lines) == 5  # header and four rows: no row broke into two
    assert "evil\\x1b[2J\\x0aname\\u202e" in out and "h\\x07:1:ab" in out
    assert lines[1].startswith("p\\x1b]0;title\\x07  q\\u200b ")
    assert lines[1].endswith(" banned\\x0d\\x0a\\x1b[31mred")
    pool_only = lease("list", POOL)[0]
    assert "\x1b" not in pool_only and "evil\\x1b[2J\\x0aname" in pool_only


@pytest.mark.django_db
def test_run_exits_75_when_no_resource_is_free_within_wait(pool, tmp_path):
    pool.acquire(ttl=60)
    pool.acquire(ttl=60)
    marker = tmp_path / "ran"
    with pytest.raises(CommandError) as caught:
        lease("run", POOL, "--wait", "0.2", "--", "touch", str(marker))
    assert caught.value.returncode == 75
    assert "no free resource in pool 'proxies' within 0.2s" in str(caught.value)
    assert not marker.exists()


@pytest.mark.django_db
def test_run_takes_durations_with_units(pool, monkeypatch):
    asked = {}
    real = Pool.acquire

    def acquire(self, **options):
        asked.update(options)
        return real(self, **options)

    monkeypatch.setattr(Pool, "acquire", acquire)
    lease("run", POOL, "--ttl", "2m", "--wait", "0s", "--grace", "1m", "--", "true")
    assert asked == {"ttl": 120.0, "wait": 0.0}


def test_run_without_the_separator_says_to_put_the_command_after_it(child_env, manage):
    argv = [*manage, "lease", "run", POOL, "ls", "-la"]
    done = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unrecognized arguments: -la; put the command after --, as in " in done.stderr
    assert "`lease run POOL [--ttl 90s] -- ls -la`" in done.stderr


def test_positionals_are_explained_in_help(child_env, manage):
    done = subprocess.run([*manage, "lease", "add", "--help"], env=child_env, capture_output=True, text=True)
    assert "the pool's name" in done.stdout and "unique in its pool" in done.stdout


# -- lease run end to end -----------------------------------------------------------------

CHILD = """
import json, os, signal, sys, time
out = sys.argv[1]
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif sys.argv[2] == "report-term":
    def on_term(signum, frame):
        open(out + ".term", "w").write("TERM\\n")
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
env = {k: v for k, v in os.environ.items() if k.startswith("LEASE_")}
open(out, "w").write(json.dumps({"pid": os.getpid(), "env": env, "argv": sys.argv[3:]}) + "\\n")
if sys.argv[2] == "exit-7":
    sys.exit(7)
time.sleep(30)
"""


@pytest.fixture
def run(child_env, manage, tmp_path):
    """Start `lease run POOL OPTIONS -- python CHILD OUT MODE ARGS`; kill leftovers at the end."""
    started: list[subprocess.Popen] = []
    out = tmp_path / "child.json"

    def start(options: list[str], mode: str, *args: str) -> subprocess.Popen:
        child = [sys.executable, "-c", CHILD, str(out), mode, *args]
        started.append(start_lease_run(manage, child_env, POOL, options, child))
        return started[-1]

    start.out = out
    yield start
    # The child first: it holds the pipes that communicate() reads to the end.
    if out.exists() and out.read_text().endswith("\n"):
        pid = json.loads(out.read_text())["pid"]
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    for proc in started:
        proc.kill()
        proc.communicate()


@pytest.mark.django_db(transaction=True)
def test_run_passes_the_lease_in_the_environment_and_exits_with_the_child_code(pool, run):
    proc = run(["--ttl", "30", "--wait", "0"], "exit-7", "--", "x")
    proc.communicate(timeout=30)
    assert proc.returncode == 7
    child = json.loads(run.out.read_text())
    assert child["argv"] == ["--", "x"]
    env = child["env"]
    assert env["LEASE_POOL"] == POOL
    resource = row(env["LEASE_NAME"])
    assert env["LEASE_TOKEN"] == str(resource.token) == "1"
    assert json.loads(env["LEASE_DATA"]) == resource.data
    assert resource.state_at(db_now()) == Resource.FREE and resource.holder == ""


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("take_away, mode", [("release", "ignore-term"), ("quarantine", "sleep")])
def test_run_stops_the_child_and_exits_75_when_the_lease_is_lost(pool, run, take_away, mode):
    proc = run(["--ttl", "1", "--grace", "1"], mode)
    child = json.loads(wait_for(run.out))
    name = child["env"]["LEASE_NAME"]
    assert alive(child["pid"])
    started = time.monotonic()
    getattr(pool, take_away)(name)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 75
    assert time.monotonic() - started < 5
    # The engine's log may warn first; the command's own message is one line.
    assert stderr.splitlines()[-1].startswith(f"CommandError: lease on proxies/{name} was lost")
    assert not alive(child["pid"])
    expected = Resource.FREE if take_away == "release" else Resource.QUARANTINED
    assert row(name).state_at(db_now()) == expected


@pytest.mark.django_db(transaction=True)
def test_sigterm_to_run_reaches_the_child_and_the_lease_is_released(pool, run):
    proc = run(["--ttl", "30"], "report-term")
    child = json.loads(wait_for(run.out))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=15)
    assert proc.returncode == 3
    assert Path(f"{run.out}.term").read_text() == "TERM\n"
    assert not alive(child["pid"])
    assert row(child["env"]["LEASE_NAME"]).state_at(db_now()) == Resource.FREE
