"""The fault proxy really injects its faults, and carries clean traffic without leaking.

Clients are plain MySQLdb connections through the proxy; what the server really did is
checked through a direct connection, so every test fails if the proxy only relays.
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest
from django.db import connection

from tests.faults.faultproxy import FaultProxy, _ClientParser

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the fault proxy relays the MySQL protocol"),
]
MySQLdb = pytest.importorskip("MySQLdb")  # installed only where MySQL is used

TABLE = "faultproxy_scratch"
LOST = (2013, 2006)  # lost connection during query / server has gone away
REFUSED = (2002, 2003)  # MariaDB Connector/C says 2002 for ECONNREFUSED, libmysqlclient 2003


def server() -> tuple[str, int]:
    s = connection.settings_dict
    return s["HOST"] or "127.0.0.1", int(s["PORT"] or 3306)


def connect(port: int | None = None, **options):
    """A MySQLdb connection to the test database, through the proxy if ``port`` is given."""
    s = connection.settings_dict
    host, direct_port = server()
    options.setdefault("connect_timeout", 5)
    return MySQLdb.connect(host=host if port is None else "127.0.0.1", port=port or direct_port,
                           user=s["USER"], password=s["PASSWORD"], database=s["NAME"], **options)


def error_code(excinfo) -> int:
    return excinfo.value.args[0]


def committed_ids() -> list[int]:
    direct = connect()
    try:
        cur = direct.cursor()
        cur.execute(f"SELECT id FROM {TABLE} ORDER BY id")
        return [row[0] for row in cur.fetchall()]
    finally:
        direct.close()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def proxy():
    with FaultProxy(upstream=server(), listen=("127.0.0.1", 0)) as p:
        yield p


@pytest.fixture
def table():
    direct = connect(autocommit=True)
    cur = direct.cursor()
    cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
    cur.execute(f"CREATE TABLE {TABLE} (id INT PRIMARY KEY) ENGINE=InnoDB")
    yield TABLE
    cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
    direct.close()


def insert_and_commit(client, row_id: int) -> None:
    client.cursor().execute(f"INSERT INTO {TABLE} (id) VALUES (%s)", (row_id,))
    client.commit()  # mysql_commit() sends the COM_QUERY "COMMIT", as Django's commit does


def test_a_dropped_commit_reply_is_a_lost_connection_although_the_row_is_committed(proxy, table):
    rule = proxy.drop_reply(r"^\s*COMMIT\b", probability=1.0, count=1)
    client = connect(proxy.port)
    with pytest.raises(MySQLdb.OperationalError) as lost:
        insert_and_commit(client, 1)
    assert error_code(lost) in LOST
    assert committed_ids() == [1]
    assert rule.dropped == 1 and proxy.stats()["dropped"] == 1
    assert wait_for(lambda: proxy.stats()["open"] == 0)  # both sockets of that connection closed

    client = connect(proxy.port)
    insert_and_commit(client, 2)  # count=1 is spent
    client.close()
    assert committed_ids() == [1, 2]
    assert rule.dropped == 1


def test_only_matching_queries_lose_their_reply_until_clear(proxy, table):
    rule = proxy.drop_reply(r"INSERT\s+INTO\s+faultproxy_scratch", probability=1.0)
    client = connect(proxy.port)
    client.cursor().execute("SELECT 1")  # does not match
    with pytest.raises(MySQLdb.OperationalError) as lost:
        client.cursor().execute(f"insert into {TABLE} (id) values (1)")  # matches, case-insensitive
    assert error_code(lost) in LOST and rule.dropped == 1
    proxy.clear()
    client = connect(proxy.port)
    insert_and_commit(client, 2)
    client.close()
    assert committed_ids() == [2] and rule.dropped == 1  # autocommit is off: row 1 was rolled back


def test_after_picks_the_commit_of_one_kind_of_transaction(proxy, table):
    rule = proxy.drop_reply(r"^\s*COMMIT\b", after=r"INSERT INTO faultproxy_scratch \(id\) VALUES \(2\)")
    client = connect(proxy.port)
    insert_and_commit(client, 1)  # another transaction's COMMIT passes
    with pytest.raises(MySQLdb.OperationalError) as lost:
        insert_and_commit(client, 2)
    assert error_code(lost) in LOST and rule.dropped == 1
    assert committed_ids() == [1, 2]


def test_seeded_probability_drops_some_commits_and_replays(proxy, table):
    seed, probability, commits = 7, 0.1, 200
    rule = proxy.drop_reply(r"^\s*COMMIT\b", probability=probability, seed=seed)
    client, lost = connect(proxy.port), 0
    for row_id in range(commits):
        try:
            insert_and_commit(client, row_id)
        except MySQLdb.OperationalError as exc:
            assert exc.args[0] in LOST
            lost += 1
            client = connect(proxy.port)
    client.close()
    replay = random.Random(seed)
    assert 0 < rule.dropped == lost == sum(replay.random() < probability for _ in range(commits)) < commits
    assert committed_ids() == list(range(commits))  # every dropped COMMIT was still committed


def test_refuse_cuts_connections_and_refuses_new_ones_on_the_same_port(proxy):
    port = proxy.port
    client = connect(port)
    proxy.refuse(seconds=1.0)
    refused_at = time.monotonic()
    with pytest.raises(MySQLdb.OperationalError) as refused:
        connect(port)
    assert error_code(refused) in REFUSED
    with pytest.raises(MySQLdb.OperationalError) as cut:
        client.cursor().execute("SELECT 1")
    assert error_code(cut) in LOST
    assert proxy.stats()["open"] == 0

    assert wait_for(lambda: can_connect(port))
    assert time.monotonic() - refused_at >= 0.9
    proxy.refuse()
    with pytest.raises(MySQLdb.OperationalError) as refused:
        connect(port)
    assert error_code(refused) in REFUSED
    proxy.allow()
    assert can_connect(port) and proxy.port == port


def can_connect(port: int) -> bool:
    try:
        connect(port).close()
    except MySQLdb.OperationalError:
        return False
    return True


def test_cut_closes_open_connections_once(proxy):
    client = connect(proxy.port)
    proxy.cut()
    with pytest.raises(MySQLdb.OperationalError) as cut:
        client.cursor().execute("SELECT 1")
    assert error_code(cut) in LOST
    assert can_connect(proxy.port)


def test_stall_hangs_queries_and_new_connections_until_resume(proxy):
    client = connect(proxy.port, read_timeout=1)
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(MySQLdb.OperationalError) as hung:
        client.cursor().execute("SELECT 1")
    assert error_code(hung) == 2013
    assert 0.8 <= time.monotonic() - started < 5
    with pytest.raises(MySQLdb.OperationalError) as hung:
        connect(proxy.port, connect_timeout=1, read_timeout=1)  # accepted, but no greeting
    assert error_code(hung) in LOST
    proxy.resume()
    client = connect(proxy.port, read_timeout=1)
    cur = client.cursor()
    cur.execute("SELECT 1")
    assert cur.fetchall() == ((1,),)


def test_a_timed_stall_holds_the_bytes_and_then_relays_them(proxy):
    client = connect(proxy.port, read_timeout=5)
    proxy.stall(seconds=0.5)
    started = time.monotonic()
    cur = client.cursor()
    cur.execute("SELECT 42")
    assert cur.fetchall() == ((42,),)
    assert 0.4 <= time.monotonic() - started < 3


def test_a_dead_upstream_is_a_lost_connection_not_a_hang():
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        with FaultProxy(upstream=unused.getsockname()) as proxy:
            with pytest.raises(MySQLdb.OperationalError) as lost:
                connect(proxy.port)
            assert error_code(lost) in LOST
            assert wait_for(lambda: proxy.stats() == {"connections": 1, "open": 0, "queries": 0, "dropped": 0})


def test_fifty_concurrent_connections():
    with FaultProxy(upstream=server()) as proxy:
        clients = [connect(proxy.port) for _ in range(50)]
        assert proxy.stats()["open"] == 50
        failures = []

        def work(client, n):
            try:
                cur = client.cursor()
                for i in range(20):
                    cur.execute("SELECT %s", (n * 100 + i,))
                    assert cur.fetchall() == ((n * 100 + i,),)
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
            finally:
                client.close()

        threads = [threading.Thread(target=work, args=(c, n)) for n, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert failures == []
        assert wait_for(lambda: proxy.stats()["open"] == 0)


def test_no_thread_or_socket_leaks_and_a_prompt_stop():
    threads_before = threading.active_count()
    fds_before = len(os.listdir("/proc/self/fd"))
    proxy = FaultProxy(upstream=server()).start()
    fds_idle = len(os.listdir("/proc/self/fd"))  # its listener, selector and wake-up sockets
    for _ in range(100):
        client = connect(proxy.port)
        client.cursor().execute("SELECT 1")
        client.close()
    assert wait_for(lambda: proxy.stats()["open"] == 0)
    stats = proxy.stats()
    assert stats["connections"] == 100 and stats["queries"] >= 100 and stats["dropped"] == 0
    assert threading.active_count() == threads_before + 1  # the relay thread only
    assert len(os.listdir("/proc/self/fd")) == fds_idle
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 2
    assert threading.active_count() == threads_before
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_packets_are_found_however_the_stream_is_split():
    def packet(seq: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "little") + bytes([seq]) + payload

    handshake = packet(1, (0x000FA68D).to_bytes(4, "little") + b"\0" * 28 + b"root\0")
    stream = (handshake + packet(3, b"auth switch response") + packet(0, b"\x03COMMIT")
              + packet(0, b"\x0e") + packet(0, b"\x03SELECT 'h\xc3\xa9'") + packet(0, b""))
    whole, bytewise = _ClientParser(), _ClientParser()
    assert whole.feed(stream) == ["COMMIT", "SELECT 'hé'"]
    split = [sql for i in range(len(stream)) for sql in bytewise.feed(stream[i:i + 1])]
    assert split == ["COMMIT", "SELECT 'hé'"]

    long = _ClientParser()
    long.feed(handshake)
    assert long.feed(packet(0, b"\x03" + b"x" * (0xFFFFFF - 1)) + packet(1, b"more")) == [None]

    tls = _ClientParser()
    assert tls.feed(packet(1, (0x0800 | 0x0200).to_bytes(4, "little") + b"\0" * 28) + b"\x16\x03\x01") == []
    assert tls.relay_only and tls.feed(packet(0, b"\x03COMMIT")) == []
