"""A small site and HTTP forward proxies for the crawl tests.

The proxies are the witnesses: each logs every request it serves as a JSON line (when it
started and ended, the lease token header, the spider's identity header, the status), so
a test can prove from the outside that no two spiders used one proxy at the same time.
Both run in threads of the calling process or, with ``python -m tests.crawl.servers``,
as a process of their own that prints their addresses as one JSON line.
"""
from __future__ import annotations

import argparse
import base64
import http.client
import json
import random
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

#: Headers that belong to one connection, not to the request a proxy forwards.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade"}


class _Server:
    """A threaded HTTP server on a free port of 127.0.0.1, serving from a daemon thread."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self  # the handler finds its server's settings here
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=type(self).__name__, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> _Server:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Scrapy's connection pool expects

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def reply(self, status: int, body: bytes, content_type: str = "text/plain") -> bool:
        """Send a whole response; False if the client went away meanwhile."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return False
        return True


def page(number: int, pages: int) -> bytes:
    """Page `number` of a site of `pages`: links to four others, so every page is reachable
    from page 0 and a crawler finds new links all the way."""
    links = sorted({(number + 1) % pages, *((number * 3 + k) % pages for k in (1, 2, 3))})
    anchors = "".join(f'<a href="/page/{n}">page {n}</a>\n' for n in links)
    return f"<html><head><title>page {number}</title></head><body>\n{anchors}</body></html>\n".encode()


class _SiteHandler(_Quiet):
    def do_GET(self) -> None:
        site: Site = self.server.owner
        parts = self.path.split("/")
        if len(parts) != 3 or parts[1] != "page" or not parts[2].isdigit() or int(parts[2]) >= site.pages:
            self.reply(404, b"no such page\n")
            return
        if site.refuses(self.headers.get("Via")):
            self.reply(429, b"too many requests from your address\n")
            return
        time.sleep(site.delay if isinstance(site.delay, float) else random.uniform(*site.delay))
        self.reply(200, page(int(parts[2]), site.pages), "text/html; charset=utf-8")


class Site(_Server):
    """`pages` pages at /page/0 ... linking to each other, each answered after `delay` s
    (a float, or a (low, high) range to draw from).

    `ban_after` = N makes it ban per proxy, as a site that counts the requests of each
    address does: the (N+1)th request through one proxy (told apart by the `Via` header
    the test proxies add) is answered 429 at once, and so is every request through that
    proxy for `ban_for` seconds; then the proxy's count starts again.
    """

    def __init__(self, pages: int = 500, delay: float | tuple[float, float] = 0.02, ban_after: int = 0,
                 ban_for: float = 1.0) -> None:
        super().__init__(_SiteHandler)
        self.pages, self.delay = pages, delay
        self.ban_after, self.ban_for = ban_after, ban_for
        self._served: dict[str, int] = {}  # requests answered per proxy since its last ban
        self._banned_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def refuses(self, via: str | None) -> bool:
        """Whether a request through the proxy named in `via` is banned (counts it if not)."""
        if not self.ban_after or via is None:
            return False
        with self._lock:
            now = time.monotonic()
            if self._banned_until.get(via, 0.0) > now:
                return True
            if self._served.get(via, 0) >= self.ban_after:
                self._banned_until[via], self._served[via] = now + self.ban_for, 0
                return True
            self._served[via] = self._served.get(via, 0) + 1
            return False


class _ProxyHandler(_Quiet):
    def do_GET(self) -> None:
        proxy: Proxy = self.server.owner
        started = time.time()
        status, body, content_type = proxy.answer(self)
        sent = self.reply(status, body, content_type)
        proxy.record({
            "proxy": proxy.name, "start": started, "end": time.time(), "status": status,
            "token": self.headers.get("X-Lease"), "spider": self.headers.get("X-Spider"),
            "user": proxy.user_of(self.headers.get("Proxy-Authorization")), "url": self.path, "sent": sent,
        })


class Proxy(_Server):
    """A forward proxy for absolute-URI GETs, logging each request to `log` (JSON lines).

    `ban_every` = N answers 403 to every Nth request (counted over all clients), as a
    target site that bans a proxy would. With `user`, requests must carry Basic
    Proxy-Authorization for `user`:`password` (407 otherwise). Forwarded requests carry
    `Via: 1.1 <name>`, by which a site tells the proxies apart.
    """

    def __init__(self, name: str, log: Path, ban_every: int = 0, user: str | None = None,
                 password: str = "") -> None:
        super().__init__(_ProxyHandler)
        self.name, self.log, self.ban_every = name, Path(log), ban_every
        self.user, self.password = user, password
        self.count = 0
        self._lock = threading.Lock()
        self._file = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 - closed by stop()

    def stop(self) -> None:
        super().stop()
        with self._lock:
            self._file.close()

    @staticmethod
    def user_of(header: str | None) -> str | None:
        """The user name of a Basic Proxy-Authorization header."""
        if not header or not header.startswith("Basic "):
            return None
        return base64.b64decode(header[6:]).decode("latin-1").partition(":")[0]

    def authorized(self, header: str | None) -> bool:
        if self.user is None:
            return True
        expected = base64.b64encode(f"{self.user}:{self.password}".encode("latin-1")).decode()
        return header == f"Basic {expected}"

    def answer(self, handler: BaseHTTPRequestHandler) -> tuple[int, bytes, str]:
        """(status, body, content type) for one request: refused, banned or forwarded."""
        if not handler.path.startswith("http://"):
            return 400, b"absolute http:// URIs only\n", "text/plain"
        if not self.authorized(handler.headers.get("Proxy-Authorization")):
            return 407, b"proxy authentication required\n", "text/plain"
        with self._lock:
            self.count += 1
            banned = self.ban_every and self.count % self.ban_every == 0
        if banned:
            return 403, b"banned\n", "text/plain"
        return self.forward(handler)

    def forward(self, handler: BaseHTTPRequestHandler) -> tuple[int, bytes, str]:
        target = urlsplit(handler.path)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP | {"via"}}
        headers["Via"] = f"1.1 {self.name}"
        upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=10)
        try:
            path = target.path + (f"?{target.query}" if target.query else "")
            upstream.request("GET", path, headers=headers)
            response = upstream.getresponse()
            return response.status, response.read(), response.getheader("Content-Type", "text/plain")
        except OSError as exc:
            return 502, f"upstream failed: {exc}\n".encode(), "text/plain"
        finally:
            upstream.close()

    def record(self, entry: dict) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(entry) + "\n")
                self._file.flush()


def read_log(path: Path) -> list[dict]:
    """The complete JSON lines of a proxy's log (a line being written is left out)."""
    if not Path(path).exists():
        return []
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


def main(argv: list[str] | None = None) -> None:
    """Serve a site and proxies until SIGTERM; print their addresses as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=500)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--max-delay", type=float, help="draw each page's delay from --delay to this")
    parser.add_argument("--proxies", type=int, default=4)
    parser.add_argument("--ban-every", type=int, default=0,
                        help="the first proxy answers 403 to every Nth request")
    parser.add_argument("--ban-after", type=int, default=0,
                        help="the site answers 429 through a proxy after this many requests through it")
    parser.add_argument("--ban-for", type=float, default=1.0, help="seconds such a ban lasts")
    parser.add_argument("--logdir", type=Path, required=True)
    args = parser.parse_args(argv)
    delay = args.delay if args.max_delay is None else (args.delay, args.max_delay)
    site = Site(args.pages, delay, args.ban_after, args.ban_for).start()
    proxies = [Proxy(f"proxy-{i}", args.logdir / f"proxy-{i}.jsonl", args.ban_every if i == 0 else 0).start()
               for i in range(args.proxies)]
    print(json.dumps({"site": site.url, "proxies": {p.name: p.url for p in proxies}}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    for server in (site, *proxies):
        server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
