"""Input checks shared by every public call (leases.validation), the error classes of
db.run, and the system check on connection timeouts."""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest
from django.db import InterfaceError, OperationalError, connection

from leases import db
from leases.db import check_databases
from leases.encoding import MAX_JSON_DEPTH, dump_json
from leases.validation import (
    MAX_SECONDS,
    check_moment,
    check_name,
    check_seconds,
    check_ttl,
    clean_text,
)


def nested(depth: int) -> object:
    value: object = 1
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


@pytest.mark.parametrize(
    "name, problem",
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        (" padded", "whitespace"),
        ("tab\t", "whitespace"),
        ("nul\x00byte", "control"),
        ("new\nline", "control"),
        ("\x1b[31mred", "control"),
        ("\ufeffbom", "control"),
        ("bidi\u202eevil", "control"),
        ("lone\ud800", "control"),
        ("x" * 101, "longer than 100"),
        (7, "non-empty string"),
    ],
)
def test_names_must_be_printable(name, problem):
    with pytest.raises(ValueError, match=problem):
        check_name(name, "pool name", 100)


def test_printable_names_pass_unchanged():
    for name in ("proxy-1", "10.0.0.1:3128", "Zürich 東京", "a b", "emoji-🙂"):
        assert check_name(name, "name", 100) == name


@pytest.mark.parametrize(
    "value, kwargs, problem",
    [
        (-1, {}, ">= 0"),
        (0, {"above": True}, "> 0"),
        (math.nan, {}, "finite"),
        (math.inf, {}, "finite"),
        (True, {}, "finite number"),
        ("5", {}, "finite number"),
        (MAX_SECONDS + 1, {}, "at most"),
        (1e12, {}, "10 years"),
        (timedelta(days=4000), {}, "at most"),
    ],
)
def test_seconds_are_bounded(value, kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        check_seconds(value, "delay", **kwargs)


def test_seconds_inside_the_bounds_pass():
    assert check_seconds(0, "wait") == 0.0
    assert check_seconds(timedelta(minutes=2), "delay") == 120.0
    assert check_seconds(MAX_SECONDS, "delay") == MAX_SECONDS


def test_a_ttl_shorter_than_a_round_trip_is_refused():
    with pytest.raises(ValueError, match="at least 0.1 seconds"):
        check_ttl(1e-9)
    assert check_ttl(0.1) == 0.1


@pytest.mark.parametrize(
    "moment, problem",
    [
        (datetime(1, 1, 1, tzinfo=timezone.utc), "within"),
        (datetime(9999, 12, 31, tzinfo=timezone.utc), "within"),
        (datetime(2030, 1, 1), "timezone-aware"),
        ("2030-01-01", "timezone-aware"),
    ],
)
def test_moments_must_be_aware_and_near(moment, problem):
    with pytest.raises(ValueError, match=problem):
        check_moment(moment, "run_at")


@pytest.mark.parametrize(
    "value, problem",
    [
        ({"x": object()}, "JSON-serialisable"),
        ({"x": math.nan}, "JSON-serialisable"),
        ({"x": {1, 2}}, "JSON-serialisable"),
        ({"text": "lone \ud800 surrogate"}, "lone surrogate"),
        (nested(MAX_JSON_DEPTH + 1), "nested deeper than 31"),
        (nested(100_000), "nested deeper than 31"),
        ("x" * (1 << 20), "over the limit"),
    ],
)
def test_json_that_a_database_would_refuse_is_a_value_error(value, problem):
    with pytest.raises(ValueError, match=problem):
        dump_json(value, "payload")


def test_the_size_limit_follows_the_setting(settings):
    settings.LEASES_MAX_JSON_BYTES = 2048
    dump_json("x" * 2000, "payload")
    with pytest.raises(ValueError, match="over the limit of 2048"):
        dump_json("é" * 1100, "payload")  # 2,200 bytes of UTF-8
    settings.LEASES_MAX_JSON_BYTES = "big"
    with pytest.raises(ValueError, match="LEASES_MAX_JSON_BYTES"):
        dump_json({}, "payload")


@pytest.mark.django_db(transaction=True)
def test_json_at_the_depth_limit_is_stored_by_the_database():
    """31 levels is what MariaDB's JSON_VALID accepts: the limit is the database's."""
    from leases.pool import Pool

    Pool("deep").add("r", data=nested(MAX_JSON_DEPTH))
    from leases.models import Resource

    assert Resource.objects.get(pool="deep").data == nested(MAX_JSON_DEPTH)
    with pytest.raises(ValueError, match="nested"):
        Pool("deep").add("s", data=nested(MAX_JSON_DEPTH + 1))
    assert Resource.objects.filter(pool="deep").count() == 1


def test_clean_text_escapes_surrogates_and_keeps_head_and_tail():
    assert clean_text("ok \ud800 then", 100) == "ok \\ud800 then"
    text = "HEAD" + "m" * 10_000 + "TAIL"
    cut = clean_text(text, 200)
    assert len(cut) <= 200 and cut.startswith("HEAD") and cut.endswith("TAIL") and "characters cut" in cut
    cut.encode("utf-8")


@pytest.mark.parametrize(
    "exc, transient",
    [
        (OperationalError(1213, "Deadlock found"), True),
        (OperationalError(1205, "Lock wait timeout exceeded"), True),
        (OperationalError(2013, "Lost connection to server during query"), True),
        (OperationalError(2006, "Server has gone away"), True),
        (OperationalError(2003, "Can't connect to server (111)"), True),
        (OperationalError("database is locked"), True),
        (OperationalError(1047, "WSREP has not yet prepared node for application use"), True),
        (OperationalError(3101, "Plugin instructed the server to rollback the current transaction."), True),
        (InterfaceError(0, ""), True),
        (OperationalError(1054, "Unknown column"), False),
        (OperationalError(1045, "Access denied"), False),
        (ValueError("no"), False),
    ],
)
def test_outages_and_lost_races_are_told_from_real_errors(exc, transient):
    assert db.transient(exc) is transient


def test_a_mysql_database_without_read_timeout_gets_a_warning(settings):
    if connection.vendor != "mysql":
        pytest.skip("the warning is about MySQL connections")
    ids = {message.id for message in check_databases(None)}
    assert "leases.W001" not in ids  # the demo settings set it
    options = connection.settings_dict["OPTIONS"]
    saved = options.pop("read_timeout")
    try:
        assert "leases.W001" in {message.id for message in check_databases(None)}
    finally:
        options["read_timeout"] = saved
