"""The fault proxy speaks PostgreSQL's protocol: it relays sessions, and its faults land.

Clients are raw psycopg 3 connections through the proxy (the proxy is tested apart from
the product, which test_faults.py runs through it); what the server really did is checked
through a direct connection, to a scratch database this module creates and drops. Without
psycopg, or without a PostgreSQL server at 127.0.0.1:5432, those tests skip; the parser's
own tests need neither.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from tests.faults.faultproxy import FaultProxy
from tests.faults.wire import PostgresParser

try:
    import psycopg
except ImportError:  # the PostgreSQL driver is optional (requirements-postgres.txt)
    psycopg = None

HOST, PORT, USER = "127.0.0.1", 5432, "postgres"
DATABASE = f"faultproxy_test_{os.getpid()}"  # one per test process: runs never share it
TABLE = "faultproxy_scratch"
COMMIT = r"^\s*COMMIT\b"


@pytest.fixture(scope="module")
def database():
    """The scratch database, created for this module and dropped after it."""
    if psycopg is None:
        pytest.skip("psycopg is not installed (requirements-postgres.txt)")
    try:
        admin = psycopg.connect(host=HOST, port=PORT, user=USER, dbname="postgres", autocommit=True,
                                connect_timeout=2)
    except psycopg.OperationalError as exc:
        pytest.skip(f"PostgreSQL does not answer at {HOST}:{PORT}: {exc}")
    with admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DATABASE}")
        yield DATABASE
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")


def connect(port: int | None = None, **options):
    """A psycopg connection to the scratch database, through the proxy if ``port`` is given."""
    options.setdefault("connect_timeout", 3)
    return psycopg.connect(host=HOST, port=port or PORT, user=USER, dbname=DATABASE, **options)


@pytest.fixture
def proxy(database):
    with FaultProxy(upstream=(HOST, PORT), protocol="postgres") as running:
        yield running


@pytest.fixture
def scratch(database):
    """No table named TABLE before the test, none after it."""
    with connect(autocommit=True) as direct:
        direct.execute(f"DROP TABLE IF EXISTS {TABLE}")
    yield TABLE
    with connect(autocommit=True) as direct:
        direct.execute(f"DROP TABLE IF EXISTS {TABLE}")


@pytest.fixture
def table(scratch):
    with connect(autocommit=True) as direct:
        direct.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY)")
    return TABLE


def committed_ids() -> list[int]:
    with connect() as direct:
        return [row[0] for row in direct.execute(f"SELECT id FROM {TABLE} ORDER BY id")]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def can_connect(port: int) -> bool:
    try:
        connect(port, connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


def test_a_session_is_relayed(proxy, scratch):
    with connect(proxy.port) as client:
        assert client.execute("SELECT 1").fetchone() == (1,)
        client.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, name text)")
        cur = client.cursor()
        cur.executemany(f"INSERT INTO {TABLE} (id, name) VALUES (%s, %s)", [(1, "un"), (2, "deux")])
        psycopg.ClientCursor(client).execute(f"INSERT INTO {TABLE} (id, name) VALUES (%s, %s)", (3, "trois"))
        with connect() as direct:  # the table itself is not committed yet
            assert direct.execute("SELECT to_regclass(%s)", (TABLE,)).fetchone() == (None,)
        client.commit()
        assert client.execute(f"SELECT name FROM {TABLE} WHERE id = %s", (2,)).fetchone() == ("deux",)
    assert committed_ids() == [1, 2, 3]
    assert wait_for(lambda: proxy.stats()["open"] == 0)
    assert proxy.stats()["dropped"] == 0 and proxy.stats()["queries"] >= 7


# The ways psycopg sends a COMMIT, and the messages each takes.
COMMITS = {
    "simple": lambda client: client.commit(),  # Query "COMMIT"
    "client-cursor": lambda client: psycopg.ClientCursor(client).execute("COMMIT"),  # Query
    "extended": lambda client: client.cursor().execute("COMMIT", binary=True),  # Parse Bind Describe Execute Sync
    "prepared": lambda client: client.cursor().execute("COMMIT", prepare=True),  # Parse Sync, then Bind ... Sync
}


@pytest.mark.parametrize("commit", COMMITS.values(), ids=COMMITS.keys())
def test_a_dropped_commit_reply_is_a_lost_connection_although_the_row_is_committed(proxy, table, commit):
    rule = proxy.drop_reply(COMMIT, probability=1.0, count=1)
    client = connect(proxy.port)
    client.cursor().execute(f"INSERT INTO {TABLE} (id) VALUES (%s)", (1,))  # extended protocol
    with pytest.raises(psycopg.OperationalError):
        commit(client)
    assert client.broken
    client.close()
    assert committed_ids() == [1]
    assert rule.dropped == 1 and proxy.stats()["dropped"] == 1
    assert wait_for(lambda: proxy.stats()["open"] == 0)  # both sockets of that connection closed

    with connect(proxy.port) as client:  # count=1 is spent
        client.execute(f"INSERT INTO {TABLE} (id) VALUES (2)")
        commit(client)
    assert committed_ids() == [1, 2] and rule.dropped == 1


@pytest.mark.parametrize("how", ["unnamed", "prepared", "prepared-earlier"])
def test_a_dropped_reply_to_a_parameterised_statement(proxy, table, how):
    """Server-side binding: the statement runs (autocommit commits it) though its reply is lost,
    also when it was prepared in an earlier round trip and only Bind/Execute name it now."""
    insert = f"INSERT INTO {TABLE} (id) VALUES (%s)"
    client = connect(proxy.port, autocommit=True)
    prepare = how != "unnamed"
    if how == "prepared-earlier":
        client.cursor().execute(insert, (1,), prepare=True)  # Parse of a named statement, Sync; Bind ...
    rule = proxy.drop_reply(r"^\s*INSERT INTO faultproxy_scratch\b")
    with pytest.raises(psycopg.OperationalError):
        client.cursor().execute(insert, (2,), prepare=prepare)
    client.close()
    assert rule.dropped == 1
    assert committed_ids() == ([1, 2] if how == "prepared-earlier" else [2])


def test_a_pipeline_loses_the_reply_once_its_sync_has_passed(proxy, table):
    client = connect(proxy.port, autocommit=True)
    rule = proxy.drop_reply(r"VALUES \(\$1\)", count=1)
    with pytest.raises(psycopg.OperationalError), client.pipeline():
        cur = client.cursor()
        for row_id in (1, 2, 3):
            cur.execute(f"INSERT INTO {TABLE} (id) VALUES (%s)", (row_id,))
    client.close()
    assert rule.dropped == 1
    assert committed_ids() == [1, 2, 3]  # the whole batch ran before its reply was lost


def test_after_picks_the_commit_of_one_kind_of_transaction(proxy, table):
    rule = proxy.drop_reply(COMMIT, after=r"^\s*DELETE\b")
    client = connect(proxy.port)
    cur = client.cursor()
    cur.executemany(f"INSERT INTO {TABLE} (id) VALUES (%s)", [(1,), (2,), (3,)])
    client.commit()  # follows an INSERT: passes
    cur.execute(f"DELETE FROM {TABLE} WHERE id = %s", (1,))
    cur.execute("SELECT 1")
    client.commit()  # follows a SELECT: passes
    cur.execute(f"DELETE FROM {TABLE} WHERE id = %s", (2,))  # an Execute, matched at its Sync
    with pytest.raises(psycopg.OperationalError):
        client.commit()
    client.close()
    assert rule.dropped == 1
    assert committed_ids() == [3]


def test_refuse_cuts_connections_and_refuses_new_ones_until_allow(proxy):
    port = proxy.port
    client = connect(port, autocommit=True)
    proxy.refuse()
    with pytest.raises(psycopg.OperationalError, match="(?i)refused"):
        connect(port)
    with pytest.raises(psycopg.OperationalError):
        client.execute("SELECT 1")
    assert proxy.stats()["open"] == 0
    proxy.allow()
    assert can_connect(port) and proxy.port == port

    proxy.refuse(seconds=0.5)
    refused_at = time.monotonic()
    assert not can_connect(port)
    assert wait_for(lambda: can_connect(port))
    assert time.monotonic() - refused_at >= 0.4


def test_cut_closes_open_connections_once(proxy):
    client = connect(proxy.port, autocommit=True)
    proxy.cut()
    with pytest.raises(psycopg.OperationalError):
        client.execute("SELECT 1")
    assert can_connect(proxy.port)


def test_stall_hangs_queries_and_new_connections_until_resume(proxy):
    client = connect(proxy.port, autocommit=True)
    outcome: dict[str, object] = {}

    def query() -> None:
        try:
            outcome["rows"] = client.execute("SELECT 42").fetchall()
        except Exception as exc:  # noqa: BLE001 - checked by the test
            outcome["error"] = exc

    proxy.stall()
    waiting = threading.Thread(target=query, daemon=True)  # psycopg has no read timeout
    try:
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and outcome == {}
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            connect(proxy.port, connect_timeout=2)  # accepted, but no server answers
        assert 1.5 <= time.monotonic() - started < 5
        assert waiting.is_alive()
    finally:
        proxy.resume()
    waiting.join(5)
    assert outcome == {"rows": [(42,)]}
    client.close()


def test_a_timed_stall_holds_the_bytes_and_then_relays_them(proxy):
    with connect(proxy.port, autocommit=True) as client:
        proxy.stall(seconds=0.5)
        started = time.monotonic()
        assert client.execute("SELECT 42").fetchall() == [(42,)]
        assert 0.4 <= time.monotonic() - started < 3


def test_the_ssl_request_is_relayed_and_answered(proxy):
    """The server has no TLS here: it answers an SSLRequest 'N', and the StartupMessage follows."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as raw:
        raw.sendall((8).to_bytes(4, "big") + PostgresParser.SSL_REQUEST.to_bytes(4, "big"))
        assert raw.recv(1) == b"N"


@pytest.mark.parametrize("sslmode", ["prefer", "disable"])
def test_queries_are_seen_after_ssl_negotiation_or_without_it(proxy, table, sslmode):
    rule = proxy.drop_reply(COMMIT, count=1)
    client = connect(proxy.port, sslmode=sslmode)
    assert not client.pgconn.ssl_in_use
    client.execute(f"INSERT INTO {TABLE} (id) VALUES (1)")
    with pytest.raises(psycopg.OperationalError):
        client.commit()
    client.close()
    assert rule.dropped == 1 and committed_ids() == [1]


def test_stats_count_simple_queries_and_executes(proxy):
    client = connect(proxy.port, autocommit=True)  # no implicit BEGIN
    client.execute("SELECT 1")  # Query
    client.execute("SELECT %s", (2,))  # Parse Bind Describe Execute Sync
    client.execute("SELECT %s", (3,), prepare=True)  # Parse Sync, then Bind Describe Execute Sync
    client.execute("SELECT %s", (3,), prepare=True)  # Bind Describe Execute Sync
    psycopg.ClientCursor(client).execute("SELECT %s", (4,))  # Query
    assert proxy.stats() == {"connections": 1, "open": 1, "queries": 5, "dropped": 0}
    client.close()
    assert wait_for(lambda: proxy.stats()["open"] == 0)


# -- the parser alone: no server needed ---------------------------------------------------

def message(kind: bytes, body: bytes = b"") -> bytes:
    return kind + (len(body) + 4).to_bytes(4, "big") + body


def untyped(code: int, body: bytes = b"") -> bytes:
    return (len(body) + 8).to_bytes(4, "big") + code.to_bytes(4, "big") + body


def parse(name: bytes, sql: bytes) -> bytes:
    return message(b"P", name + b"\0" + sql + b"\0" + (0).to_bytes(2, "big"))


def bind(portal: bytes, statement: bytes, value: bytes = b"x" * 1000) -> bytes:
    params = (1).to_bytes(2, "big") + len(value).to_bytes(4, "big") + value
    return message(b"B", portal + b"\0" + statement + b"\0" + (0).to_bytes(2, "big") + params + b"\0\0")


def execute(portal: bytes = b"") -> bytes:
    return message(b"E", portal + b"\0" + (0).to_bytes(4, "big"))


SYNC, FLUSH = message(b"S"), message(b"H")
STARTUP = untyped(196608, b"user\0postgres\0database\0x\0\0")


def test_messages_are_found_however_the_stream_is_split():
    stream = (untyped(PostgresParser.SSL_REQUEST) + untyped(PostgresParser.GSSENC_REQUEST) + STARTUP
              + message(b"p", b"SCRAM-SHA-256\0...") + message(b"Q", "SELECT 'h\u00e9'\0".encode())
              + parse(b"", b"COMMIT") + bind(b"", b"") + message(b"D", b"P\0") + execute()
              + SYNC  # an unnamed statement: its Execute is a query once the Sync is read
              + parse(b"s1", b"INSERT INTO t VALUES ($1)") + message(b"D", b"Ss1\0") + SYNC  # not run
              + bind(b"", b"s1") + execute() + bind(b"p2", b"s1") + execute(b"p2") + FLUSH
              + message(b"C", b"Ss1\0") + SYNC + bind(b"", b"s1") + execute() + SYNC  # closed: unknown
              + message(b"X"))
    expected = ["SELECT 'hé'", "COMMIT", "INSERT INTO t VALUES ($1)", "INSERT INTO t VALUES ($1)", None]
    assert PostgresParser().feed(stream) == expected
    bytewise = PostgresParser()
    assert [sql for i in range(len(stream)) for sql in bytewise.feed(stream[i:i + 1])] == expected


def test_an_execute_is_reported_only_when_its_batch_ends():
    parser = PostgresParser()
    assert parser.feed(STARTUP + parse(b"", b"COMMIT") + bind(b"", b"") + execute()) == []
    assert parser.feed(SYNC) == ["COMMIT"]
    assert parser.feed(parse(b"", b"SELECT 1") + bind(b"", b"") + execute()) == []
    assert parser.feed(message(b"Q", b"SELECT 2\0")) == ["SELECT 1", "SELECT 2"]


def test_a_query_too_long_to_keep_is_a_query_without_text():
    parser = PostgresParser()
    parser.feed(STARTUP)
    huge = b"SELECT '" + b"x" * 0xFFFFFF + b"'"
    assert parser.feed(message(b"Q", huge + b"\0") + parse(b"big", huge) + bind(b"", b"big") + execute()
                       + SYNC + message(b"Q", b"SELECT 1\0")) == [None, None, "SELECT 1"]


def test_tls_and_unknown_streams_are_only_relayed():
    tls = PostgresParser()
    assert tls.feed(untyped(PostgresParser.SSL_REQUEST) + b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc") == []
    assert tls.relay_only and tls.feed(message(b"Q", b"COMMIT\0")) == []

    direct_tls = PostgresParser()  # sslnegotiation=direct: TLS from the first byte
    assert direct_tls.feed(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc") == [] and direct_tls.relay_only

    cancel = PostgresParser()
    assert cancel.feed(untyped(PostgresParser.CANCEL_REQUEST, b"\0\0\0\x01\0\0\0\x02")) == []
    assert not cancel.relay_only


def test_the_protocol_is_checked():
    with pytest.raises(ValueError, match="protocol"):
        FaultProxy(protocol="oracle")
    assert FaultProxy(protocol="postgres").upstream == ("127.0.0.1", 5432)
    assert FaultProxy().upstream == ("127.0.0.1", 3306)
