"""Masking of the shapes a credential also takes: header pairs, a command line's options,
the keys pw and bearer, a name and its value with only a space between, and the
positional arguments of a Django task. Prose and tracebacks stay readable, and masking
stays linear on long input."""
from __future__ import annotations

import json
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leases.ops import masking
from leases.ops.masking import MASK, is_secret, mask_secrets, mask_text

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task()
def sign_in(user: str, password: str, *tokens: str, region: str = "eu") -> None:
    """A task whose second and later positional arguments are credentials."""


@task(takes_context=True)
def with_context(context, api_key: str, page: int) -> None:
    """A task whose first parameter is the context, which no argument binds to."""


TASK = f"{__name__}.sign_in"


@pytest.mark.parametrize("key", ["pw", "PW", "db_pw", "smtp-pw", "bearer", "Bearer", "bearer_token"])
def test_pw_and_bearer_are_secret_keys(key):
    assert is_secret(key)
    assert mask_secrets({key: "s3"}) == {key: MASK}


@pytest.mark.parametrize("key", ["upward", "pwn2own", "newspaper"])
def test_pw_inside_a_word_is_not(key):
    assert not is_secret(key)


@pytest.mark.parametrize("text, masked", [
    ("token abc123", f"token {MASK}"),
    ("curl --api-key abc123 https://api", f"curl --api-key {MASK} https://api"),
    ("login with password 'hun ter2' failed", f"login with password '{MASK}' failed"),
    ('PASSWORD "x"', f'PASSWORD "{MASK}"'),
    ("sent Bearer eyJhbGci.eyJzdWIi.sig to api", f"sent Bearer {MASK} to api"),
    ("mysql -u app --password\thunter2", f"mysql -u app --password\t{MASK}"),
    ("db_pw s3cret", f"db_pw {MASK}"),
    ("X-Access-Token: abc", f"X-Access-Token: {MASK}"),  # still the header form
    ("token expired", f"token {MASK}"),  # broad, but says nothing wrong
])
def test_a_secret_name_and_its_value_with_a_space_between(text, masked):
    assert mask_text(text) == masked


@pytest.mark.parametrize("text", [
    "KeyError: 'token'",
    "KeyError: 'token' not in the session",
    "the token is invalid",
    "for key in keys:",
    "if not token or expired:",
    "password for bob rejected",
    "bypassword",
    ('Traceback (most recent call last):\n  File "/app/auth.py", line 9, in refresh_token\n'
     "    return session.get(url)\nrequests.exceptions.HTTPError: 401"),
])
def test_prose_and_tracebacks_stay_readable(text):
    assert mask_text(text) == text


def test_header_pairs_and_command_lines_are_masked_by_position():
    headers = [["Authorization", "Bearer abc"], ("X-Api-Key", "k1"), ["Accept", "json"]]
    assert mask_secrets({"headers": headers}) == {
        "headers": [["Authorization", MASK], ["X-Api-Key", MASK], ["Accept", "json"]]
    }
    argv = ["mysql", "-u", "app", "--password", "hunter2", "--api-key=k2", "db"]
    assert mask_secrets(argv) == ["mysql", "-u", "app", "--password", MASK, f"--api-key={MASK}", "db"]
    assert mask_secrets(("token", "t1")) == ["token", MASK]
    assert mask_secrets(["user:pw@h:3128", {"n": 1}]) == [f"user:{MASK}@h:3128", {"n": 1}]  # text, not a name


def test_a_tasks_positional_arguments_are_masked_by_their_parameters_names():
    payload = {"args": ["bob", "hunter2", "t1", "t2"], "kwargs": {"region": "us", "password": "p2"}}
    assert masking.mask_task_call(TASK, payload) == {
        "args": ["bob", MASK, MASK, MASK], "kwargs": {"region": "us", "password": MASK},
    }
    context = {"args": ["k1", 3], "kwargs": {}}
    assert masking.mask_task_call(f"{__name__}.with_context", context) == {"args": [MASK, 3], "kwargs": {}}


@pytest.mark.parametrize("path", ["nowhere.at_all", f"{__name__}.TASK", "", "no dots"])
def test_every_positional_argument_is_masked_when_the_task_cannot_be_read(path):
    masked = masking.mask_task_call(path, {"args": ["bob", 7], "kwargs": {"n": 1}})
    assert masked == {"args": [MASK, MASK], "kwargs": {"n": 1}}


def test_a_payload_of_another_shape_is_masked_as_any_other():
    assert masking.mask_task_call(TASK, {"token": "t"}) == {"token": MASK}
    assert masking.mask_task_call(TASK, ["password=x"]) == [f"password={MASK}"]


@pytest.mark.parametrize("text", [
    "token " * 40_000, "token '" * 40_000, "--api-key " * 40_000, "a" * 250_000,
    "password '" + "x" * 250_000, "x_token" * 40_000 + " v",
])
def test_masking_stays_linear_on_long_input(text):
    started = time.perf_counter()
    mask_text(text)
    assert time.perf_counter() - started < 2.0  # quadratic would take minutes


# -- a planted secret never shows, whatever its shape -----------------------------------

EXAMPLES = settings(max_examples=200, deadline=None)
SECRET = "S3KR1T"
#: A credential's characters: tokens, base64, URLs' safe characters.
secret_values = st.text(string.ascii_letters + string.digits + "-_./+~!#$%^*", max_size=30).map(
    lambda tail: SECRET + tail
)
credential_names = st.builds(
    lambda dashes, before, word, case: dashes + before + getattr(word, case)(),
    st.sampled_from(["", "-", "--"]),
    st.sampled_from(["", "x_", "client-", "db."]),
    st.sampled_from(["token", "password", "passwd", "passphrase", "pwd", "pw", "secret", "bearer", "api_key",
                     "api-key", "apikey", "access_key", "private-key"]),
    st.sampled_from(["lower", "upper", "title"]),
)
words = st.lists(st.text(string.ascii_letters, min_size=1, max_size=8), max_size=3).map(" ".join)


@EXAMPLES
@given(name=credential_names, space=st.sampled_from([" ", "  ", "\t"]), value=secret_values,
       quote=st.sampled_from(["", "'", '"']), before=words, after=words)
def test_a_value_after_a_credential_name_never_shows(name, space, value, quote, before, after):
    if quote:
        value = f"{value} and more"  # a quoted value may hold spaces
    text = f"{before} {name}{space}{quote}{value}{quote} {after}"
    assert SECRET not in mask_text(text)


@EXAMPLES
@given(name=credential_names, value=secret_values, shape=st.sampled_from(["dict", "pair", "tuple", "option"]),
       around=st.lists(st.sampled_from(["x", "-v", "Accept", 3, None]), max_size=3))
def test_a_secret_in_a_structure_never_shows(name, value, shape, around):
    planted = {
        "dict": {name: value},
        "pair": [[name, value]],
        "tuple": (name, value),
        "option": ["cmd", *around, "--" + name.lstrip("-"), value, *around],
    }[shape]
    assert SECRET not in json.dumps(mask_secrets({"headers": planted, "more": around}))


@EXAMPLES
@given(user=st.text(string.ascii_letters, min_size=1, max_size=8), secrets=st.lists(secret_values, min_size=1,
       max_size=4), task_path=st.sampled_from([TASK, "gone.task"]))
def test_a_secret_passed_to_a_task_by_position_never_shows(user, secrets, task_path):
    masked = masking.mask_task_call(task_path, {"args": [user, *secrets], "kwargs": {}})
    assert SECRET not in json.dumps(masked)
    assert masked["args"][0] == (user if task_path == TASK else MASK)
