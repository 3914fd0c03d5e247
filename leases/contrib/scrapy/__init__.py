"""A Scrapy downloader middleware that sends a spider's requests through a leased proxy.

Each spider holds one resource of a pool (a proxy) at a time, so two crawlers never
share a proxy, a crawler that dies frees its proxy within the ttl, and a banned proxy
is quarantined and swapped for another while the request is retried on it. A proxy the
spider gives up (a rotation, a ban for its target) is released only once the requests
out on it are done, and a spider that closes releases every proxy it took::

    DOWNLOADER_MIDDLEWARES = {"leases.contrib.scrapy.LeasesMiddleware": 700}
    LEASES_POOL = "proxies"      # resources whose data is {"url": "http://10.0.0.1:3128"}

Order 700 puts it before Scrapy's HttpProxyMiddleware (750), which turns the userinfo
of `request.meta["proxy"]` into a Proxy-Authorization header. It needs the asyncio
reactor (Scrapy's default). Settings:

- ``LEASES_POOL`` (required; without it the middleware is off): the pool of proxies.
- ``LEASES_TTL`` (60): seconds a proxy of a crawler that died stays out of use.
- ``LEASES_WAIT`` (300): seconds a request waits for a proxy; then the spider closes
  with reason ``leases_no_resource``.
- ``LEASES_FAIR`` (False): serve waiting spiders in the order they came.
- ``LEASES_QUARANTINE`` (1800): seconds a banned proxy stays out of the pool.
- ``LEASES_BAN_POLICY`` (``leases.contrib.scrapy.BanPolicy``): import path of a class
  with ``response_is_ban(request, response)`` and ``exception_is_ban(request,
  exception)``; built with ``from_crawler`` if it has one.
- ``LEASES_BAN_RETRIES`` (5): times a banned request is retried on the next proxy before
  it is dropped (stat ``leases/bans_gave_up``).
- ``LEASES_ROTATE_REQUESTS`` (0, never) and ``LEASES_ROTATE_SECONDS`` (0, never): swap
  the proxy after that many requests or seconds, once the requests out on it are done;
  ``LEASES_ROTATE_COOLDOWN`` (0): seconds the proxy rotated out rests before anyone gets
  it again.
- ``LEASES_PROXY`` (``leases.contrib.scrapy.proxy_url``): import path of a function
  ``(resource_data, lease) -> str`` giving the proxy URL of a resource.
- ``LEASES_TOKEN_HEADER`` (None): a header that carries ``<pool>/<name> <token>`` on each
  request, so the proxy or the site can refuse a holder whose lease has passed on.
- ``LEASES_DATABASE_URL`` (None): for a process with no Django project; Django is set up
  on that database unless it is configured already.
- ``LEASES_HOLDER`` (host:pid): the holder name stored in the lease.
- ``LEASES_TARGET`` (None): the site this spider crawls. With it, a ban is that target's
  only (`leases.targets`): the proxy is banned for the target for ``LEASES_QUARANTINE``
  seconds and, once the requests out on it are done, released for other spiders' targets
  and jobs of other targets; the spider only takes proxies its target does not refuse
  (the bans jobs of the queue record too). Without it, a ban quarantines the proxy for
  everyone at once (it goes to nobody, so nothing waits).

A request whose ``meta`` has ``leases_skip`` or a ``proxy`` of its own is left alone.
Every request sent through a lease carries ``meta["leases"]`` (pool, name, id, token).
Stats: ``leases/acquired``, ``leases/lost``, ``leases/replaced``, ``leases/requests``,
``leases/bans`` (quarantined or banned for the target the current proxy), ``leases/bans_ignored`` (seen through a
proxy already given up), ``leases/bans_gave_up``, ``leases/rotations`` and
``leases/waited_seconds`` (time the spider spent without a proxy).
"""
from .config import BanPolicy, Config, proxy_url
from .middleware import LeasesMiddleware

__all__ = ["BanPolicy", "Config", "LeasesMiddleware", "proxy_url"]
