"""What operators see and do of per-target state from the shell: `lease targets` (in force,
how a pool stands for a target, the history), `lease lift` (per resource, per target,
logged), the same through `python -m leases` on a host without a project, and the log a
ban or a rest leaves (who said it, once after a retry)."""
from __future__ import annotations

import io
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from leases import Pool, targets
from leases.clock import db_now
from leases.models import Resource, ResourceTarget, Verdict
from tests.conftest import database_url

pytestmark = pytest.mark.django_db(transaction=True)


def lease(*args: str) -> str:
    out = io.StringIO()
    call_command("lease", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


@pytest.fixture
def pool():
    """proxies p1..p6 (p6 of two slots): p1 banned and p2 resting for shop.example, p3 held,
    p4 quarantined, p5 cooling down; p6 free; p2 banned for other.example too."""
    p = Pool("proxies")
    for name in ("p1", "p2", "p3", "p4", "p5"):
        p.add(name)
    p.add("p6", slots=2)
    targets.ban("proxies", "p1", "shop.example", 600, "429 too many", holder="crawler-a:11")
    targets.rest("proxies", "p2", "shop.example", 30, holder="crawler-a:11")
    targets.ban("proxies", "p2", "other.example", 3600, "403")
    p.quarantine("p4", 3600, "dead")
    now = db_now()
    Resource.objects.filter(pool="proxies", name="p3").update(busy_before=now + timedelta(seconds=60), holder="someone")
    Resource.objects.filter(pool="proxies", name="p5").update(busy_before=now + timedelta(seconds=20), holder="")
    return p


def test_standing_counts_each_slot_once_in_order_and_names_the_next_one_back(pool):
    found = targets.standing("proxies", "shop.example")
    assert (found.slots, found.resources, found.usable) == (7, 6, 2)  # p6's two slots
    assert (found.quarantined, found.held, found.cooling, found.banned, found.rested, found.paced) == (1, 1, 1, 1, 1, 0)
    assert not found.blocked
    other = targets.standing("proxies", "other.example")
    assert (other.usable, other.banned, other.rested) == (3, 1, 0)  # p2 banned there; p1 usable there
    plain = targets.standing("proxies")  # jobs of no target: no bans apply
    assert (plain.usable, plain.banned) == (4, 0)
    # Only p6 left usable: take both its slots; the next back is p2, whose rest ends first.
    for _ in range(2):
        Pool("proxies", target="shop.example").acquire(ttl=60, wait=0, holder="x")
    stuck = targets.standing("proxies", "shop.example")
    assert stuck.blocked and stuck.held == 3
    assert stuck.next_why == "a cool-down ends"  # p5's 20 s, before p2's 30 s rest
    assert stuck.summary().startswith("0 of 7 slots usable for shop.example: 1 quarantined, 3 held, 1 cooling down,"
                                      " 1 banned, 1 resting; the next ")


def test_a_filter_counts_the_free_slots_it_turns_away(pool):
    Resource.objects.filter(pool="proxies", name="p6").update(data={"region": "eu"})
    found = targets.standing("proxies", "shop.example", lambda data: data.get("region") == "us")
    assert (found.usable, found.filtered) == (0, 2)
    assert "1 resting, 2 not matching the handler's where=; the next " in found.summary()


def test_lease_targets_lists_what_is_in_force_and_how_a_pool_stands_for_a_target(pool):
    listed = rows(lease("targets"))
    assert listed[0] == ["POOL", "NAME", "TARGET", "BANNED", "RESTING", "PACED", "REASON"]
    assert listed[1][:5] == ["proxies", "p1", "shop.example", "in", "9m"]
    assert listed[1][-3:] == ["429", "too", "many"]
    assert [line[:3] for line in listed[2:]] == [["proxies", "p2", "other.example"], ["proxies", "p2", "shop.example"]]
    one = lease("targets", "proxies", "--target", "shop.example").splitlines()
    assert one[0] == ("proxies: 2 of 7 slots usable for shop.example: 1 quarantined, 1 held, 1 cooling down,"
                      " 1 banned, 1 resting")
    assert [line.split()[1] for line in one[2:]] == ["p1", "p2"]
    assert [line[1] for line in rows(lease("targets", "--resource", "p2"))[1:]] == ["p2", "p2"]
    assert lease("targets", "proxies", "--target", "nobody.example").splitlines()[1] == "no bans, rests or paces in force"


def test_lease_lift_per_resource_or_per_target_is_logged(pool):
    assert lease("lift", "proxies", "p2") == ("lifted the bans and rests of proxies: p2 for other.example,"
                                              " p2 for shop.example\n")
    assert lease("lift", "proxies", "--target", "shop.example", "--reason", "new exit IP") == (
        "lifted the bans and rests of proxies: p1 for shop.example\n")
    assert lease("lift", "proxies", "--target", "shop.example") == (
        "nothing to lift: no ban or rest of proxies for shop.example in force\n")
    now = db_now()
    assert not [row for row in ResourceTarget.objects.all() if row.state_at(now) in ("banned", "rested")]
    lifts = list(Verdict.objects.filter(kind="lift").order_by("id"))
    assert [(v.name, v.target) for v in lifts] == [("p2", "other.example"), ("p2", "shop.example"),
                                                   ("p1", "shop.example")]
    assert all(v.holder.startswith("lease lift (") for v in lifts) and lifts[-1].reason == "new exit IP"
    history = rows(lease("targets", "--history", "--limit", "4"))
    assert history[0] == ["AT", "POOL", "NAME", "TARGET", "VERDICT", "UNTIL", "BY", "REASON"]
    assert [line[3:6] for line in history[1:]] == [["p1", "shop.example", "lifted"], ["p2", "shop.example", "lifted"],
                                                   ["p2", "other.example", "lifted"], ["p2", "other.example", "banned"]]
    said = rows(lease("targets", "proxies", "--resource", "p1", "--history"))
    assert said[-1][3:7] == ["p1", "shop.example", "banned", said[-1][6]] and "crawler-a:11" in said[-1]


@pytest.mark.parametrize("args, message", [
    (("lift", "proxies"), "lift: name a resource, --target, or both"),
    (("lift", "proxies", "p9"), "no resource 'p9' in pool 'proxies'"),
    (("lift", "nopool", "p1"), "pool 'nopool' has no resources"),
    (("lift", "proxies", "p1", "--target", ""), "target"),
    (("lift", "proxies", "p1", "--target", "a\nb"), "control or invisible characters"),
    (("targets", "nopool"), "pool 'nopool' has no resources"),
    (("targets", "--limit", "0"), "--limit must be a whole number from 1 to 10000"),
    (("targets", "--history", "--limit", "x"), "--limit must be a whole number"),
    (("targets", "--target", "x" * 300), "longer than 255"),
])
def test_bad_input_is_one_line_and_changes_nothing(pool, args, message):
    before = (list(ResourceTarget.objects.values()), Verdict.objects.count())
    with pytest.raises(CommandError) as error:
        lease(*args)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert error.value.returncode == 2
    assert (list(ResourceTarget.objects.values()), Verdict.objects.count()) == before


def test_the_commands_as_processes_and_through_python_m_leases(pool, manage, child_env):
    """`manage.py lease lift` as users run it (system checks and all), exit 2 on bad input;
    `python -m leases URL lease targets` on a host without a project, which says what it
    cannot run there."""
    done = subprocess.run([*manage, "lease", "lift", "proxies", "p1"], env=child_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "lifted the bans and rests of proxies: p1 for shop.example\n"
    bad = subprocess.run([*manage, "lease", "lift", "proxies"], env=child_env, capture_output=True, text=True)
    assert (bad.returncode, bad.stderr.strip().splitlines()[-1]) == (
        2, "CommandError: lift: name a resource, --target, or both (a whole pool is not lifted at once)")
    env = {key: value for key, value in child_env.items() if key != "DJANGO_SETTINGS_MODULE"}
    bare = subprocess.run([sys.executable, "-m", "leases", database_url(), "lease", "targets", "proxies", "--target",
                           "shop.example"], env=env, cwd="/", capture_output=True, text=True)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.splitlines()[0] == ("proxies: 3 of 7 slots usable for shop.example: 1 quarantined, 1 held,"
                                           " 1 cooling down, 1 resting")  # p1's ban lifted above
    other = subprocess.run([sys.executable, "-m", "leases", database_url(), "jobs", "stats"], env=env, cwd="/",
                           capture_output=True, text=True)
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1
    assert other.stderr.startswith("python -m leases: no command 'jobs' here. Without a Django project it runs the"
                                   " leases app's `lease`")


def test_a_verdict_retried_after_a_lost_reply_is_logged_once(pool, monkeypatch):
    """A ban whose reply was lost runs again (`resumed`): the ban's upsert is the same twice,
    and its log line is not written a second time."""
    from leases import db

    real = db.run

    def twice(work, using=None, **options):
        real(work, using, **options)  # committed, and the reply "lost"
        return real(lambda cursor, resumed: work(cursor, True), using, **options)

    monkeypatch.setattr(db, "run", twice)
    targets.ban("proxies", "p6", "shop.example", 60, "captcha", holder="crawler-b:7")
    monkeypatch.setattr(db, "run", real)
    assert Verdict.objects.filter(name="p6", kind="ban").count() == 1
    targets.ban("proxies", "p6", "shop.example", 60, "captcha again", holder="crawler-b:7")
    assert Verdict.objects.filter(name="p6", kind="ban").count() == 2  # a new ban is a new line


def test_pruning_forgets_old_lines_of_the_log(pool):
    Verdict.objects.update(at=db_now() - timedelta(days=3))
    targets.ban("proxies", "p6", "shop.example", 60, "fresh")
    targets.forget(older_than=86400)
    assert list(Verdict.objects.values_list("reason", flat=True)) == ["fresh"]


def test_the_operators_reads_are_index_reads_on_mysql():
    """What a target refuses, a resource's last verdict and a job's verdicts are read
    through their indexes however many rows the tables hold."""
    from django.db import connection

    from leases.sql import statements

    if connection.vendor != "mysql":
        pytest.skip("EXPLAIN checked on MySQL/MariaDB")
    Pool("proxies").add_many([(f"r{n}", None) for n in range(2000)])
    for n in range(0, 2000, 10):
        targets.ban("proxies", f"r{n}", f"s{n % 7}", 600, holder="h")
    st = statements(connection, "target")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE TABLE leases_resource, leases_resourcetarget, leases_verdict")
        cursor.fetchall()
        for sql, params, index in [(st.refused, ["proxies", "s1"], "leases_resource_target"),
                                   (st.last_said, ["proxies", "r10", "s3"], "leases_verdict_resource"),
                                   (st.in_force.replace(" FOR UPDATE", ""), ["proxies", "", "", "s1", "s1"],
                                    "leases_resource_target")]:
            cursor.execute("EXPLAIN " + sql, params)
            columns = [c[0] for c in cursor.description]
            plan = dict(zip(columns, cursor.fetchone()))  # the first table read
            assert plan["key"] == index, plan
        query = Verdict.objects.filter(job=5).order_by("-at", "-id")[:50]
        cursor.execute("EXPLAIN " + str(query.query).replace("= 5", "= %s"), [5])
        plan = dict(zip([c[0] for c in cursor.description], cursor.fetchone()))
        assert plan["key"] == "leases_verdict_job", plan
