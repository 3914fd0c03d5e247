"""What the fault proxy reads of a client's byte stream: the queries in it, per protocol.

One parser per protocol, each with the same interface: ``feed(data)`` takes the bytes a
client sent, however recv() split them, and returns the queries they completed, in order,
each as its SQL text (None when it cannot be matched: too long, or a statement the parser
never saw prepared). A query is reported once the server is bound to run it and answer, so
the proxy can lose the answer by cutting the connection at the first byte of the reply.
``relay_only`` turns true when the stream is no longer readable (TLS, compression); the
proxy then only relays.
"""
from __future__ import annotations

MAX_QUERY = 0xFFFFFF  # longer queries are relayed but not kept to be matched (None)


class MySQLParser:
    """Cuts a MySQL client's stream into packets to find the COM_QUERY ones.

    A COM_QUERY is its own round trip: it is reported as soon as its last packet is read.
    """

    COM_QUERY = 0x03
    CLIENT_COMPRESS = 0x0020
    CLIENT_SSL = 0x0800
    MAX_PAYLOAD = 0xFFFFFF  # a payload this long continues in the next packet

    def __init__(self) -> None:
        self._header = b""
        self._remaining: int | None = None  # payload bytes still due; None while reading a header
        self._seq = 0
        self._long = False
        self._body: bytearray | None = None  # payload kept only while it may be a query
        self._first = True
        self.relay_only = False  # TLS or compression: the stream is no longer readable packets

    def feed(self, data: bytes) -> list[str | None]:
        """The COM_QUERY packets completed by ``data``: their SQL, or None if too long to match."""
        queries: list[str | None] = []
        pos = 0
        while pos < len(data) and not self.relay_only:
            if self._remaining is None:
                part = data[pos:pos + 4 - len(self._header)]
                self._header += part
                pos += len(part)
                if len(self._header) < 4:
                    break
                self._remaining = int.from_bytes(self._header[:3], "little")
                self._seq = self._header[3]
                self._long = self._remaining == self.MAX_PAYLOAD
                self._header = b""
                # Commands start at sequence 0; the first packet carries the capabilities.
                self._body = bytearray() if self._first or self._seq == 0 else None
            part = data[pos:pos + self._remaining]
            pos += len(part)
            self._remaining -= len(part)
            if self._body is not None:
                self._body += part
                if not self._first and self._body and self._body[0] != self.COM_QUERY:
                    self._body = None  # another command: no need to keep its payload
            if self._remaining == 0:
                self._remaining = None
                if self._first:
                    self._first = False
                    caps = int.from_bytes(self._body[:4], "little")
                    self.relay_only = bool(caps & (self.CLIENT_SSL | self.CLIENT_COMPRESS))
                elif self._body:
                    queries.append(None if self._long else self._body[1:].decode("utf-8", "replace"))
                self._body = None
        return queries


class PostgresParser:
    """Cuts a PostgreSQL (protocol 3) client's stream into messages to find the queries.

    The stream opens with untyped packets (int32 length, int32 code): an SSLRequest or
    GSSENCRequest, which the server answers with one byte, then the StartupMessage; typed
    messages (a type byte, an int32 length that counts itself, the body) follow.

    A simple query ('Q') is reported when read: the server runs it and answers. In the
    extended protocol the query text comes in a Parse ('P', maybe of a named statement
    prepared in an earlier round trip), a Bind ('B') makes a portal of a statement, and an
    Execute ('E') runs a portal: each Execute is reported, with the text of its statement,
    once the Sync ('S') or Flush ('H') that makes the server answer has been read. A Parse
    alone runs nothing (psycopg's prepare=True sends Parse and Sync first), so it is no query.
    """

    SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST = 80877103, 80877104, 80877102
    MAX_STARTUP = 10000  # the server refuses longer startup packets
    NAMES_ONLY = 256  # of a Bind, Execute or Close, only the names at the start are kept

    def __init__(self) -> None:
        self._startup = True  # untyped packets until the StartupMessage has passed
        self._header = bytearray()
        self._type = 0
        self._length = 0
        self._keep = 0  # how much of the body is kept
        self._remaining: int | None = None  # body bytes still due; None while reading a header
        self._body: bytearray | None = None  # kept only for the messages that name queries
        self._statements: dict[bytes, str | None] = {}  # prepared statement -> its SQL
        self._portals: dict[bytes, str | None] = {}  # portal -> the SQL it runs
        self._batch: list[str | None] = []  # Executes waiting for the Sync or Flush
        self.relay_only = False  # TLS, GSSAPI encryption or garbage: relay without reading

    def feed(self, data: bytes) -> list[str | None]:
        """The queries that ``data`` makes the server run and answer, in order."""
        queries: list[str | None] = []
        pos = 0
        while pos < len(data) and not self.relay_only:
            if self._remaining is None:
                part = data[pos:pos + (8 if self._startup else 5) - len(self._header)]
                self._header += part
                pos += len(part)
                if not self._header_done():
                    break
            part = data[pos:pos + self._remaining]
            pos += len(part)
            self._remaining -= len(part)
            if self._body is not None and len(self._body) < self._keep:
                self._body += part[:self._keep - len(self._body)]
            if self._remaining == 0:
                self._remaining = None
                if not self._startup:
                    self._message(queries)
                self._body = None
        return queries

    def _header_done(self) -> bool:
        """Read a complete header: set up for its body. False while the header is incomplete."""
        if len(self._header) < (8 if self._startup else 5):
            return False
        if self._startup:
            length = int.from_bytes(self._header[:4], "big")
            code = int.from_bytes(self._header[4:8], "big")
            if not 8 <= length <= self.MAX_STARTUP:
                self.relay_only = True  # a TLS record (0x16 0x03 ...) reads as a huge length
            elif code >> 16 == 3:
                self._startup = False  # the StartupMessage: typed messages follow its body
            elif code not in (self.SSL_REQUEST, self.GSSENC_REQUEST, self.CANCEL_REQUEST):
                self.relay_only = True  # GSSAPI-encrypted tokens, or no PostgreSQL client
            self._remaining, self._body = length - 8, None
        else:
            self._type = self._header[0]
            self._length = int.from_bytes(self._header[1:5], "big") - 4
            if self._length < 0:
                self.relay_only = True
            self._remaining = self._length
            self._keep = MAX_QUERY if self._type in b"QP" else self.NAMES_ONLY
            self._body = bytearray() if self._type in b"QPBEC" else None
        self._header.clear()
        return not self.relay_only

    def _message(self, queries: list[str | None]) -> None:
        """A typed message is complete: note what it prepares, binds or runs."""
        kind, body = bytes([self._type]), bytes(self._body or b"")
        complete = self._length <= self._keep
        if kind == b"Q":
            queries.extend(self._batch)
            self._batch.clear()
            queries.append(_text(body, 0) if complete else None)
        elif kind == b"P":
            name, end = _cstring(body, 0)
            self._statements[name] = _text(body, end) if complete else None
        elif kind == b"B":
            portal, end = _cstring(body, 0)
            statement, _ = _cstring(body, end)
            self._portals[portal] = self._statements.get(statement)
        elif kind == b"E":
            self._batch.append(self._portals.get(_cstring(body, 0)[0]))
        elif kind == b"C":
            names = self._statements if body[:1] == b"S" else self._portals
            names.pop(_cstring(body, 1)[0], None)
        elif kind in b"SH":  # Sync or Flush: the server answers what came before
            queries.extend(self._batch)
            self._batch.clear()


def _cstring(body: bytes, start: int) -> tuple[bytes, int]:
    """The NUL-terminated string at ``start`` and where the next field begins."""
    end = body.find(b"\0", start)
    end = len(body) if end < 0 else end
    return body[start:end], end + 1


def _text(body: bytes, start: int) -> str:
    return _cstring(body, start)[0].decode("utf-8", "replace")


PARSERS = {"mysql": MySQLParser, "postgres": PostgresParser}
