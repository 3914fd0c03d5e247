"""Generated bad input thrown at the Python API and the operator commands: every call must
answer with one clear line (ValueError, or the LeaseError that names the problem; a
command's CommandError with exit code 2) and leave every table as it was."""
from __future__ import annotations

import math

import pytest
from django.core.management import CommandError, call_command
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.jobs  # noqa: F401 - registers noop
from leases import Pool, lock, targets
from leases.encoding import MAX_JSON_DEPTH
from leases.exceptions import LeaseError
from leases.models import Lock, Resource, ResourceTarget, Verdict
from leases.tasks import Dispatcher, push, push_many
from leases.tasks.models import Job, PoolTask, Queue, TaskPool
from leases.validation import MAX_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI must not turn red by chance
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- what bad input looks like ---------------------------------------------------------------

controls = st.sampled_from(["\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\ufeff", "\u202e", "\ud800"])
bad_names = st.one_of(
    st.just(""),
    st.text(alphabet=" \t", min_size=1, max_size=3),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=5), controls, st.text(max_size=5)),
    st.builds(lambda s: " " + s, st.text(min_size=1, max_size=5).filter(str.strip)),
    st.text(alphabet="x", min_size=600, max_size=700),
    st.integers(),
    st.none(),
    st.binary(min_size=1, max_size=5),
)
bad_seconds = st.one_of(
    st.floats(max_value=-1e-9, allow_nan=False),
    st.just(math.nan),
    st.just(math.inf),
    st.floats(min_value=MAX_SECONDS * 1.01, max_value=1e300),
    st.booleans(),
    st.text(max_size=3),
)
bad_ttls = st.one_of(bad_seconds, st.floats(min_value=0, max_value=0.099))


def deep(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = {"k": [value]}
    return value


bad_json = st.one_of(
    st.builds(object),
    st.sets(st.integers(), min_size=1, max_size=3),
    st.just(math.nan),
    st.builds(lambda s: {"t": "x" + s + "\udc80"}, st.text(max_size=5)),
    st.integers(min_value=MAX_JSON_DEPTH // 2 + 1, max_value=200).map(deep),
    st.just(deep(5000)),
    st.just("x" * (1 << 20)),
)


# -- what "nothing written" means ---------------------------------------------------------------

MODELS = (Resource, ResourceTarget, Verdict, Lock, Job, PoolTask, TaskPool, Queue)


def snapshot() -> tuple[int, ...]:
    return tuple(model.objects.count() for model in MODELS)


def refused(call, *args, **kwargs) -> Exception:
    """Run `call`; it must fail with one clear line and write nothing."""
    before = snapshot()
    with pytest.raises((ValueError, TypeError, LeaseError)) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert message and "\n" not in message and "Traceback" not in message, message
    assert snapshot() == before
    return caught.value


# -- the Python API ---------------------------------------------------------------------------------


@EXAMPLES
@given(name=bad_names)
def test_bad_names_are_refused_everywhere(name):
    refused(Pool, name)
    refused(Pool("good").add, name)
    refused(lambda: lock(name).__enter__())
    if name is not None:  # None: the handler's own queue
        refused(push, "noop", {}, queue=name)
    refused(Dispatcher, name)
    refused(Dispatcher("d").recreate_task_pool, {name: 1.0})
    refused(Dispatcher("d").assign_tasks, 5, name)
    refused(targets.ban, "good", "r", name, 60)
    refused(targets.ban, "good", name, "site", 60)
    refused(targets.lift, "good", name)
    if name not in ("", None, 0):  # no target given: the resource's bans for every target
        refused(targets.lift, "good", "r", name)


@EXAMPLES
@given(ttl=bad_ttls, wait=bad_seconds)
def test_bad_durations_are_refused_everywhere(ttl, wait):
    Pool("bounded").add("r") if not Resource.objects.exists() else None
    before = snapshot()
    refused(Pool("bounded").acquire, ttl=ttl)
    refused(Pool("bounded").acquire, ttl=60, wait=wait)
    refused(Pool("bounded").quarantine, "r", seconds=ttl)
    refused(lambda: lock("l", ttl=ttl).__enter__())
    refused(push, "noop", {}, delay=wait)
    refused(Dispatcher, "d", stale_after=wait)
    assert snapshot() == before


@EXAMPLES
@given(value=bad_json)
def test_json_a_database_would_refuse_is_refused_before_writing(value):
    refused(Pool("data").add, "r", data=value)
    refused(push, "noop", value)
    refused(push_many, [("noop", {"ok": 1}), ("noop", value)])


@EXAMPLES
@given(priority=st.one_of(st.integers().filter(lambda p: not -100 <= p <= 100), st.floats(), st.booleans()),
       key=st.one_of(st.just(""), st.text(min_size=256, max_size=300), st.builds(lambda s: s + "\ud800", st.text())))
def test_bad_job_options_are_refused(priority, key):
    refused(push, "noop", {}, priority=priority)
    refused(push, "noop", {}, key=key)


# -- the commands ------------------------------------------------------------------------------------


def command_refused(*args: str) -> None:
    before = snapshot()
    with pytest.raises(CommandError) as caught:
        call_command(*args)
    assert caught.value.returncode == 2, caught.value
    assert "\n" not in str(caught.value)
    assert snapshot() == before


# As command arguments: no NUL (argv cannot carry one), and no leading "-", which argparse
# reads as an option (a usage error before the command sees it).
printable_bad_names = bad_names.filter(lambda n: isinstance(n, str) and "\x00" not in n and not n.startswith("-"))


@EXAMPLES
@given(name=printable_bad_names, duration=st.sampled_from(["0", "-5", "nan", "inf", "1e12", "soon", "4000d"]))
def test_commands_refuse_bad_input_with_one_line(name, duration):
    Pool("pool").add("r") if not Resource.objects.exists() else None
    TaskPool.objects.get_or_create(name="crawl")
    command_refused("lease", "add", "pool", name)
    command_refused("lease", "add", name, "resource")
    command_refused("lease", "quarantine", "pool", "r", "--for", duration)
    command_refused("lease", "run", "pool", "--ttl", duration, "--", "true")
    command_refused("lease", "run", "pool", "--ttl", "0.01", "--", "true")
    command_refused("dispatch", "assign", "crawl", name, "5")
    command_refused("leases_prune", "--older-than", duration)
    command_refused("lease", "lift", "pool", "r", "--target", name)
    command_refused("lease", "targets", "pool", "--target", name)
    command_refused("lease", "targets", "--resource", name)


@EXAMPLES
@given(data=st.one_of(st.just("{"), st.just("[" * 5000), st.just('{"a": NaN}'), st.text(max_size=3).map(lambda s: "x" + s + "}")))
def test_bad_json_on_the_command_line_is_one_line(data):
    command_refused("lease", "add", "pool", "r", "--data", data)
