"""The crawl tests' fixture: a site, proxies and spider processes, stopped after the test."""
from __future__ import annotations

import pytest


@pytest.fixture
def crawl(tmp_path):
    from tests.crawl.harness import Crawl

    c = Crawl(tmp_path, "crawl-proxies")
    yield c
    c.close()
