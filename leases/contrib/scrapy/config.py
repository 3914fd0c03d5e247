"""The middleware's settings (`Config`), its default idea of a ban (`BanPolicy`) and of a
proxy's URL (`proxy_url`), and how it sets Django up in a process without a project."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit, urlunsplit

from scrapy import Request
from scrapy.core.downloader.handlers.http11 import TunnelError
from scrapy.exceptions import NotConfigured
from scrapy.utils.misc import load_object
from twisted.internet.error import ConnectError, ConnectionLost
from twisted.internet.error import TimeoutError as UserTimeout
from twisted.web.client import ResponseFailed

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings

    from ...lease import Lease


class BanPolicy:
    """The default idea of a ban: the site answered 403 or 429, or the proxy could not be
    reached, dropped the connection or refused a tunnel (a dead or blocked proxy is as
    useless as a banned one). Subclass it and name yours in LEASES_BAN_POLICY."""

    statuses = frozenset({403, 429})
    #: ConnectError covers refused connections, TCP timeouts and a proxy host that does
    #: not resolve; ResponseFailed a connection lost before or during the response.
    exceptions: tuple[type[BaseException], ...] = (ConnectError, ConnectionLost, ResponseFailed, TunnelError)
    #: Not bans: DOWNLOAD_TIMEOUT running out (Twisted files it under ConnectError) may
    #: just be a slow site. Take it out of here if your proxies hang rather than refuse.
    excluded: tuple[type[BaseException], ...] = (UserTimeout,)

    def response_is_ban(self, request: Request, response: Response) -> bool:
        return response.status in self.statuses

    def exception_is_ban(self, request: Request, exception: BaseException) -> bool:
        return isinstance(exception, self.exceptions) and not isinstance(exception, self.excluded)


def proxy_url(resource: Any, lease: Lease) -> str:
    """The proxy URL of a resource: its data's ``url`` (or the data, if it is a string),
    with its ``username`` and ``password`` put into the URL's userinfo, which Scrapy's
    HttpProxyMiddleware sends as Proxy-Authorization."""
    if isinstance(resource, str):
        return resource
    url = resource.get("url") if isinstance(resource, dict) else None
    if not isinstance(url, str) or not url:
        raise ValueError(f"the data of {lease.pool}/{lease.name} has no 'url'")
    user, password = resource.get("username"), resource.get("password")
    if user is None:
        return url
    parts = urlsplit(url)
    userinfo = quote(str(user), safe="") + ("" if password is None else ":" + quote(str(password), safe=""))
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc.rpartition('@')[2]}"))


@dataclass(frozen=True)
class Config:
    """The LEASES_* settings, read once (see the module's docstring)."""

    pool: str
    ttl: float = 60
    wait: float = 300
    fair: bool = False
    quarantine: float = 1800
    ban_policy: str = "leases.contrib.scrapy.BanPolicy"
    ban_retries: int = 5
    rotate_requests: int = 0
    rotate_seconds: float = 0
    rotate_cooldown: float = 0
    proxy: str = "leases.contrib.scrapy.proxy_url"
    token_header: str | None = None
    database_url: str | None = None
    holder: str | None = None
    target: str | None = None

    @classmethod
    def from_settings(cls, settings: BaseSettings) -> Config:
        pool = settings.get("LEASES_POOL")
        if not pool:
            raise NotConfigured("LEASES_POOL is not set")
        d = cls(pool=pool)
        return cls(
            pool=pool,
            ttl=settings.getfloat("LEASES_TTL", d.ttl),
            wait=settings.getfloat("LEASES_WAIT", d.wait),
            fair=settings.getbool("LEASES_FAIR", d.fair),
            quarantine=settings.getfloat("LEASES_QUARANTINE", d.quarantine),
            ban_policy=settings.get("LEASES_BAN_POLICY") or d.ban_policy,
            ban_retries=settings.getint("LEASES_BAN_RETRIES", d.ban_retries),
            rotate_requests=settings.getint("LEASES_ROTATE_REQUESTS", d.rotate_requests),
            rotate_seconds=settings.getfloat("LEASES_ROTATE_SECONDS", d.rotate_seconds),
            rotate_cooldown=settings.getfloat("LEASES_ROTATE_COOLDOWN", d.rotate_cooldown),
            proxy=settings.get("LEASES_PROXY") or d.proxy,
            token_header=settings.get("LEASES_TOKEN_HEADER") or None,
            database_url=settings.get("LEASES_DATABASE_URL") or None,
            holder=settings.get("LEASES_HOLDER") or None,
            target=settings.get("LEASES_TARGET") or None,
        )


def setup_django(database_url: str | None) -> None:
    """Make the leases models usable: a process with no Django project is set up on
    `database_url`; one that has a project keeps it (`leases.configure` decides)."""
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    from ...setup import configure

    if not database_url and not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ImproperlyConfigured("leases.contrib.scrapy: set LEASES_DATABASE_URL (or configure Django)")
    configure(database_url=database_url or "")


def build(path: str, crawler: Crawler) -> Any:
    """An instance of the class at `path`, through its `from_crawler` if it has one."""
    cls = load_object(path)
    return cls.from_crawler(crawler) if hasattr(cls, "from_crawler") else cls()
