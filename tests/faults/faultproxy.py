"""A TCP proxy between database clients and the server that misbehaves on command.

Tests and the soak script put it in front of the server to prove that clients survive what
real networks and servers do: a reply lost after COMMIT although the server committed, a
refused connection, a server that hangs. One background thread relays every connection
through a selector, so fifty connections cost no extra threads, nothing the proxy does
waits on the network, and the control methods return as soon as the change holds.

It speaks MySQL/MariaDB's protocol or PostgreSQL's (protocol 3). Only the client's byte
stream is parsed, and only to find the queries in it (tests/faults/wire.py); bytes are
always relayed unchanged.
"""
from __future__ import annotations

import errno
import logging
import math
import queue
import random
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

from tests.faults.wire import PARSERS, MySQLParser, PostgresParser

_ClientParser = MySQLParser  # its earlier name, which test_faultproxy.py imports

logger = logging.getLogger(__name__)

CHUNK = 65536
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_WAKE, _LISTEN = "wake", "listen"  # selector data of the two sockets that are no connection


class DropRule:
    """Loses the server's reply to matching queries; ``dropped`` counts the replies lost.
    With ``refuse``, each lost reply also begins an outage of that many seconds (inf: until
    allow())."""

    def __init__(self, pattern: str, probability: float, count: int | None, seed: int | None,
                 after: str | None = None, refuse: float | None = None) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be within [0, 1], not {probability!r}")
        if count is not None and count < 0:
            raise ValueError(f"count must be None or >= 0, not {count!r}")
        self.pattern = re.compile(pattern, re.IGNORECASE)
        self.after = re.compile(after, re.IGNORECASE) if after is not None else None
        self.probability = probability
        self.count = count
        self.refuse = refuse
        self.dropped = 0
        self._armed = 0  # queries forwarded whose reply is still to be lost
        self._random = random.Random(seed)

    def _fires(self, sql: str, previous: str) -> bool:
        """One draw per matching query, so a seed replays; armed drops count against ``count``.
        With ``after``, only a query that follows a match of it on the same connection matches
        (the COMMIT of one kind of transaction, say)."""
        if not self.pattern.search(sql) or (self.after is not None and not self.after.search(previous)):
            return False
        if self.count is not None and self.dropped + self._armed >= self.count:
            return False
        return self._random.random() < self.probability

    def __repr__(self) -> str:
        return (f"DropRule({self.pattern.pattern!r}, probability={self.probability}, "
                f"count={self.count}, dropped={self.dropped})")


class _Conn:
    """A client's socket, its upstream socket, and the bytes each still has to take."""

    __slots__ = ("client", "closing", "connecting", "drop", "last", "parser", "server", "to_client", "to_server")

    def __init__(self, client: socket.socket, parser: MySQLParser | PostgresParser) -> None:
        self.client = client
        self.server: socket.socket | None = None  # None until connected upstream (deferred while stalled)
        self.connecting = False
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.parser = parser
        self.drop: DropRule | None = None  # the rule that will lose the reply now awaited
        self.last = ""  # the connection's previous query, for rules with ``after``
        self.closing = False  # one side ended: flush what the other side is owed, then close


class FaultProxy:
    """Relays connections to ``upstream`` and injects faults on command.

    ``protocol`` is "mysql" (MySQL and MariaDB) or "postgres" (PostgreSQL); ``upstream``
    defaults to that server's usual port on 127.0.0.1. Start it with ``start()`` or a
    ``with`` block; ``port`` is where clients connect.
    """

    def __init__(self, upstream: tuple[str, int] | None = None,
                 listen: tuple[str, int] = ("127.0.0.1", 0), protocol: str = "mysql") -> None:
        if protocol not in PARSERS:
            raise ValueError(f"protocol must be one of {sorted(PARSERS)}, not {protocol!r}")
        self.protocol = protocol
        self.upstream = upstream or ("127.0.0.1", 5432 if protocol == "postgres" else 3306)
        self.listen = listen
        self._rules: tuple[DropRule, ...] = ()
        self._rules_lock = threading.Lock()
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event, list[Exception]]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._conns: set[_Conn] = set()
        self._listener: socket.socket | None = None  # None while refusing
        self._reserved: socket.socket | None = None  # bound, not listening: holds the port while refusing
        self._address: tuple = ()
        self._refuse_until: float | None = None
        self._stalled = False
        self._stall_until: float | None = None
        self._running = False
        self._accepted = self._queries = self._dropped = 0

    # -- control, from any thread ----------------------------------------------------------

    def start(self) -> Self:
        """Bind here, so ``port`` is known and a bad address raises in the caller; relay in a thread."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        family, _, _, _, upstream = socket.getaddrinfo(*self.upstream, type=socket.SOCK_STREAM)[0]
        self._upstream = (family, upstream)
        family, _, _, _, address = socket.getaddrinfo(*self.listen, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self._family = family
        listener = self._bind(address)
        self._address = listener.getsockname()  # the real port, to listen again on the same one
        listener.listen(socket.SOMAXCONN)
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(self._wake_r, READ, _WAKE)
        self._selector.register(listener, READ, _LISTEN)
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"faultproxy:{self.port}", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        """The port clients connect to; the same through refuse() and allow()."""
        if not self._address:
            raise RuntimeError("FaultProxy not started")
        return self._address[1]

    def drop_reply(self, pattern: str, probability: float = 1.0, count: int | None = None,
                   seed: int | None = None, after: str | None = None, refuse: float | None = None) -> DropRule:
        """Lose the reply to matching queries once the server has begun it, i.e. has run them;
        with ``after``, only to those that follow a query matching it on their connection;
        with ``refuse``, then refuse connections for that many seconds (``math.inf``: until
        allow()), as an outage that began with that reply would.

        The connection is cut at the first byte of the reply. A MySQL COM_QUERY or a
        PostgreSQL simple query is matched when read; a PostgreSQL Execute (extended
        protocol) is matched, with the text its statement was parsed from, once the Sync or
        Flush that ends its batch has been read, so the server runs the whole batch first."""
        rule = DropRule(pattern, probability, count, seed, after, refuse)
        with self._rules_lock:
            self._rules = (*self._rules, rule)
        return rule

    def clear(self) -> None:
        """Remove every drop rule (a drop already waiting on its reply still happens)."""
        with self._rules_lock:
            self._rules = ()

    def refuse(self, seconds: float | None = None) -> None:
        """An outage: cut every connection and refuse new ones for ``seconds`` or until allow()."""
        self._call(lambda: self._refuse(seconds))

    def allow(self) -> None:
        """End refuse(): listen again, on the same port."""
        self._call(self._allow)

    def stall(self, seconds: float | None = None) -> None:
        """A hung server: relay no byte either way, sockets kept open, for ``seconds`` or until resume()."""
        self._call(lambda: self._stall(seconds))

    def resume(self) -> None:
        """End stall(): relay again whatever was held back."""
        self._call(self._resume)

    def cut(self) -> None:
        """Close every open connection once; new connections work."""
        self._call(self._cut)

    def stats(self) -> dict[str, int]:
        """Counters so far: connections accepted, open now, queries seen (MySQL COM_QUERYs,
        PostgreSQL simple queries and Executes), replies dropped."""
        return {"connections": self._accepted, "open": len(self._conns),
                "queries": self._queries, "dropped": self._dropped}

    def stop(self) -> None:
        """Close every socket and join the thread; harmless if never started or already stopped."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            self._call(self._halt)
            thread.join(5)
        self._wake_w.close()

    def __enter__(self) -> Self:
        return self if self._thread is not None else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the relay thread and wait, so the fault holds when the caller goes on."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("FaultProxy is not running")
        done, errors = threading.Event(), []
        self._calls.put((fn, done, errors))
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the wake-up socket is full of wake-ups already
        if not done.wait(5):
            raise RuntimeError("FaultProxy relay thread did not answer")
        if errors:
            raise errors[0]

    # -- the relay thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._running:
                for key, mask in self._selector.select(self._timeout()):
                    if key.data == _WAKE:
                        self._run_calls()
                    elif key.data == _LISTEN:
                        self._accept()
                    else:
                        conn, from_client = key.data
                        if conn in self._conns:  # not closed earlier in this batch
                            try:
                                self._handle(conn, from_client, mask)
                            except Exception:  # one connection's bug must not end the relay
                                logger.exception("faultproxy: closing a connection after an error")
                                self._close(conn)
                self._expire()
        finally:
            self._cut()
            for sock in (self._listener, self._reserved, self._wake_r):
                if sock is not None:
                    sock.close()
            self._selector.close()
            while True:  # calls that raced with stop(): fail them rather than leave them waiting
                try:
                    _, done, errors = self._calls.get_nowait()
                except queue.Empty:
                    break
                errors.append(RuntimeError("FaultProxy stopped"))
                done.set()

    def _timeout(self) -> float | None:
        deadlines = [t for t in (self._refuse_until, self._stall_until) if t is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        if self._refuse_until is not None and now >= self._refuse_until:
            self._allow()
        if self._stall_until is not None and now >= self._stall_until:
            self._resume()

    def _run_calls(self) -> None:
        try:
            self._wake_r.recv(4096)
        except BlockingIOError:
            pass
        while True:
            try:
                fn, done, errors = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - raised again in the calling thread
                errors.append(exc)
            finally:
                done.set()

    def _halt(self) -> None:
        self._running = False

    def _bind(self, address: tuple) -> socket.socket:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            # Without SO_REUSEADDR the port could not be bound again while cut connections linger
            # in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _refuse(self, seconds: float | None) -> None:
        self._refuse_until = None if seconds is None else time.monotonic() + seconds
        self._cut()
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            # Bound but not listening: connect() gets ECONNREFUSED and no one else takes the port.
            self._reserved = self._bind(self._address)

    def _allow(self) -> None:
        self._refuse_until = None
        if self._listener is None:
            listener = self._reserved or self._bind(self._address)
            self._reserved = None
            listener.listen(socket.SOMAXCONN)
            self._selector.register(listener, READ, _LISTEN)
            self._listener = listener

    def _stall(self, seconds: float | None) -> None:
        self._stall_until = None if seconds is None else time.monotonic() + seconds
        self._stalled = True
        for conn in list(self._conns):
            self._update(conn)

    def _resume(self) -> None:
        self._stall_until = None
        self._stalled = False
        for conn in list(self._conns):
            if conn in self._conns and conn.server is None:
                self._connect(conn)
            if conn in self._conns:
                self._update(conn)

    def _cut(self) -> None:
        for conn in list(self._conns):
            self._close(conn)

    def _accept(self) -> None:
        if self._listener is None:
            return
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        except OSError as exc:  # out of file descriptors: let clients wait in the backlog
            logger.warning("faultproxy: accept failed: %s", exc)
            time.sleep(0.1)
            return
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(client, PARSERS[self.protocol]())
        self._conns.add(conn)
        self._accepted += 1
        if not self._stalled:  # a hung server accepts but never greets; connect on resume()
            self._connect(conn)
        if conn in self._conns:
            self._update(conn)

    def _connect(self, conn: _Conn) -> None:
        family, address = self._upstream
        try:
            server = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            logger.warning("faultproxy: no socket for upstream: %s", exc)
            self._close(conn)
            return
        conn.server = server
        server.setblocking(False)
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = server.connect_ex(address)
        if error == 0:
            return
        if error == errno.EINPROGRESS:
            conn.connecting = True
        else:
            self._close(conn)  # the client sees its connection lost, as with a server that is down

    def _handle(self, conn: _Conn, from_client: bool, mask: int) -> None:
        if not from_client and conn.connecting:
            if conn.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._close(conn)
                return
            conn.connecting = False
        elif self._stalled:
            pass  # stall() came earlier in this batch of events
        elif from_client:
            if mask & READ:
                self._read_client(conn)
            if mask & WRITE and conn in self._conns:
                self._send(conn, conn.client, conn.to_client)
        else:
            if mask & READ:
                self._read_server(conn)
            if mask & WRITE and conn in self._conns:
                self._send(conn, conn.server, conn.to_server)
        if conn in self._conns:
            self._update(conn)

    def _recv(self, sock: socket.socket) -> bytes | None:
        """Bytes read, b"" at the end of the stream (or a reset), None if nothing is there yet."""
        try:
            return sock.recv(CHUNK)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _read_client(self, conn: _Conn) -> None:
        data = self._recv(conn.client)
        if data is None:
            return
        if not data:
            conn.to_client.clear()
            conn.closing = True
            return
        for sql in conn.parser.feed(data):
            self._queries += 1
            if sql is not None and conn.drop is None:
                conn.drop = next((rule for rule in self._rules if rule._fires(sql, conn.last)), None)
                if conn.drop is not None:
                    conn.drop._armed += 1
            conn.last = sql or ""
        conn.to_server += data
        if conn.server is not None and not conn.connecting:
            self._send(conn, conn.server, conn.to_server)

    def _read_server(self, conn: _Conn) -> None:
        data = self._recv(conn.server)
        if data is None:
            return
        if data and conn.drop is not None:
            # The reply has begun, so the server has run the statement: lose the reply.
            rule, conn.drop = conn.drop, None
            rule._armed -= 1
            rule.dropped += 1
            self._dropped += 1
            self._close(conn)
            if rule.refuse is not None:
                self._refuse(None if math.isinf(rule.refuse) else rule.refuse)
            return
        if not data:
            conn.to_server.clear()
            conn.closing = True
            return
        conn.to_client += data
        self._send(conn, conn.client, conn.to_client)

    def _send(self, conn: _Conn, sock: socket.socket, pending: bytearray) -> None:
        try:
            sent = sock.send(pending)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del pending[:sent]

    def _update(self, conn: _Conn) -> None:
        """Ask the selector for exactly what this connection can do now.

        A side is read only once what it sent before has been passed on (backpressure), and
        nothing is read or written while stalled.
        """
        if conn.closing and not conn.to_server and not conn.to_client:
            self._close(conn)
            return
        live = not self._stalled
        reading = live and not conn.closing
        events = (READ if reading and not conn.to_server else 0) | (WRITE if live and conn.to_client else 0)
        self._watch(conn.client, events, (conn, True))
        if conn.server is not None:
            if conn.connecting:
                events = WRITE
            else:
                events = ((READ if reading and not conn.to_client else 0)
                          | (WRITE if live and conn.to_server else 0))
            self._watch(conn.server, events, (conn, False))

    def _watch(self, sock: socket.socket, events: int, data: tuple[_Conn, bool]) -> None:
        key = self._selector.get_map().get(sock)
        if key is None:
            if events:
                self._selector.register(sock, events, data)
        elif not events:
            self._selector.unregister(sock)
        elif key.events != events:
            self._selector.modify(sock, events, data)

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.remove(conn)
        if conn.drop is not None:
            conn.drop._armed -= 1
            conn.drop = None
        for sock in (conn.client, conn.server):
            if sock is not None:
                if sock in self._selector.get_map():
                    self._selector.unregister(sock)
                sock.close()
