"""The fault-injection proxy between the tests and MariaDB, and the "proxied" alias."""
from __future__ import annotations

import copy

import pytest
from django.db import connection, connections
from django.db.utils import load_backend

from tests.conftest import Workers, database_url
from tests.faults.faultproxy import FaultProxy

#: The proxy's protocol for each vendor it can stand in front of.
PROTOCOLS = {"mysql": ("mysql", 3306), "postgresql": ("postgres", 5432)}


@pytest.fixture
def proxy():
    """A proxy in front of the test database's server (MySQL's or PostgreSQL's protocol)."""
    if connection.vendor not in PROTOCOLS:
        pytest.skip("the fault-injection proxy speaks the MySQL and PostgreSQL protocols")
    protocol, port = PROTOCOLS[connection.vendor]
    settings = connection.settings_dict
    upstream = (settings["HOST"] or "127.0.0.1", int(settings["PORT"] or port))
    with FaultProxy(upstream=upstream, protocol=protocol) as running:
        yield running


@pytest.fixture
def proxied(proxy):
    """The alias "proxied": this test database through the proxy, for this thread only (a
    connection the test framework does not know is not fenced off by it)."""
    conf = copy.deepcopy(connections["default"].settings_dict)
    conf.update(HOST="127.0.0.1", PORT=proxy.port)
    conf["OPTIONS"].update(connect_timeout=2)
    if connection.vendor == "mysql":
        conf["OPTIONS"].update(read_timeout=3)
    connections["proxied"] = load_backend(conf["ENGINE"]).DatabaseWrapper(conf, alias="proxied")
    yield "proxied"
    connections["proxied"].close()
    del connections["proxied"]


@pytest.fixture
def proxied_workers(manage, child_env, tmp_path, proxy):
    """`leases_worker` processes whose database is reached through the proxy, with short
    timeouts so that a stalled server becomes an error within seconds."""
    url = database_url().replace(":3306/", f":{proxy.port}/").replace(":5432/", f":{proxy.port}/")
    assert str(proxy.port) in url
    # libpq has no read timeout: a stalled PostgreSQL link holds its caller until it wakes.
    timeouts = "read_timeout=3&write_timeout=3" if url.startswith("mysql") else "tcp_user_timeout=3000"
    env = {**child_env, "DATABASE_URL": f"{url}?{timeouts}&connect_timeout=2"}
    procs = Workers(manage, env, tmp_path)
    yield procs
    procs.cleanup()
