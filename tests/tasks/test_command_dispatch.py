"""`manage.py dispatch`: what operators run, with its exit codes and bad input."""
from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from leases import lock
from leases.tasks import Dispatcher
from leases.tasks.models import DispatchWorker, PoolTask, TaskPool

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str) -> str:
    from io import StringIO

    out, err = StringIO(), StringIO()
    call_command("dispatch", *args, stdout=out, stderr=err)
    return out.getvalue().strip()


def fails(code: int, *args: str) -> str:
    with pytest.raises(CommandError) as info:
        run(*args)
    assert info.value.returncode == code
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.csv"
    path.write_text("# value,score\nhttp://a/?x=1,2\n\nhttp://b/,1.5\nhttp://c/,-3\nhttp://b/,0.5\n")
    return path


def test_load_assign_done_check_stats(tasks_file):
    assert run("load", "crawl", str(tasks_file)) == "3 tasks in the pool of crawl"
    assert json.loads(run("assign", "crawl", "w1", "2")) == ["http://c/", "http://b/"]
    run("check", "crawl", "w1", "http://b/", "http://c/")
    assert "holds other tasks" in fails(1, "check", "crawl", "w1", "http://b/")
    assert run("done", "crawl", "w1", "http://c/") == "1"
    stats = json.loads(run("stats", "crawl"))
    assert (stats["pool"], stats["assigned"], stats["done"]) == (1, 1, 1)
    assert stats["workers"]["w1"]["bucket"] == 1
    assert run("done", "crawl", "w1") == "1"


def test_reclaim_with_a_duration():
    Dispatcher("crawl").recreate_task_pool({"a": 1.0})
    Dispatcher("crawl").assign_tasks(1, "w1")
    assert run("reclaim", "crawl", "--stale-after", "10m") == "0 tasks back in the pool"
    DispatchWorker.objects.update(last_seen=timezone.now() - timedelta(minutes=11))
    assert run("reclaim", "crawl", "--stale-after", "10m") == "1 tasks back in the pool"
    assert "--stale-after: not a duration: 'soon'" in fails(2, "reclaim", "crawl", "--stale-after", "soon")


@pytest.mark.parametrize(
    "content, message",
    [
        ("a,1\nb\nc,3\n", "line 2: expected value,score"),
        ("a,1\nb,high\n", "line 2: score 'high' is not a number"),
        ("a,1\n\n# x\nb,nan\n", "line 4: score 'nan' is not a finite number"),
        (",1\n", "line 1: expected value,score"),
        ("x" * 600 + ",1\n", "task is longer than 512"),
    ],
)
def test_a_malformed_file_names_the_line_and_loads_nothing(tmp_path, content, message):
    Dispatcher("crawl").recreate_task_pool({"old": 1.0})
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert message in fails(2, "load", "crawl", str(path))
    assert list(PoolTask.objects.values_list("value", flat=True)) == ["old"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("load", "crawl", "/nonexistent/file.csv"), "cannot read /nonexistent/file.csv"),
        (("stats", "nope"), "unknown dispatcher 'nope'"),
        (("assign", "nope", "w", "5"), "unknown dispatcher 'nope'"),
        (("assign", "crawl", "w", "0"), "limit must be a whole number > 0"),
        (("assign", "crawl", "", "5"), "worker name must be a non-empty string"),
        (("assign", "crawl", "w" * 300, "5"), "worker name is longer than 255"),
        (("stats", ""), "dispatcher name must be a non-empty string"),
        (("done", "crawl", "nobody"), "no worker 'nobody' in dispatcher 'crawl': never assigned tasks, "
                                      "or reclaimed (known workers: w1)"),
        (("check", "crawl", "nobody"), "no worker 'nobody'"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    Dispatcher("crawl").recreate_task_pool({"a": 1.0, "b": 2.0})
    Dispatcher("crawl").assign_tasks(1, "w1")
    before = list(PoolTask.objects.values_list("value", "state"))
    assert message in fails(2, *args)
    assert list(PoolTask.objects.values_list("value", "state")) == before


def test_a_concurrent_rebuild_is_refused_with_exit_75(tasks_file):
    with lock("dispatch-rebuild:crawl", ttl=30):
        assert "PROCESSING LOCKED: dispatch-rebuild:crawl" in fails(75, "load", "crawl", str(tasks_file))
    assert not TaskPool.objects.filter(name="crawl", rebuilt_at__isnull=False).exists()


def test_the_command_line_exit_codes(tasks_file, child_env, manage):
    def cli(*args):
        return subprocess.run([*manage, "dispatch", *args], env=child_env, capture_output=True, text=True, timeout=60)

    loaded = cli("load", "crawl", str(tasks_file))
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(cli("assign", "crawl", "w1", "5").stdout) == ["http://c/", "http://b/", "http://a/?x=1"]
    bad = cli("assign", "crawl", "w1", "-1")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["CommandError: limit must be a whole number > 0, not -1"]
    # What argparse refuses is one line too, not the usage text and then the error:
    many = cli("assign", "crawl", "w1", "many")
    assert (many.returncode, many.stdout) == (2, "")
    assert many.stderr.splitlines() == [
        "CommandError: manage.py dispatch assign: argument limit: invalid int value: 'many' (see --help)"
    ]
