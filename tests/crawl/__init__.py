"""Tests of the Scrapy downloader middleware (leases.contrib.scrapy) with real Scrapy processes."""
