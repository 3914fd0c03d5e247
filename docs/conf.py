"""Sphinx configuration of the django-leases documentation (`make docs`).

The pages are Markdown (MyST), so they read on GitHub as they are. Django is set up with
the demo project's settings before autodoc runs, so the apps import as they do in a
project; the docs never touch a database.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

# The demo project's settings; the build reads no DATABASE_URL of the machine's, and
# connects to no database.
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
os.environ["DATABASE_URL"] = "sqlite:///:memory:"
os.environ["DATABASE_URL_SECOND"] = "sqlite:///:memory:"

import django  # after the environment above

django.setup()

project = "django-leases"
author = "the django-leases authors"
copyright = "2026, the django-leases authors"
release = version = __import__("leases").__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "django_commands",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Headings get anchors (#the-claim) down to this level, as GitHub gives them.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
# `name` in a docstring is a Python object, linked when documented here.
default_role = "py:obj"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"

html_theme = "furo"
html_title = f"django-leases {release}"
html_static_path: list[str] = []

# A code block whose text Pygments cannot lex whole (the SQL of design.md writes the
# server clock as `{now}`) is still highlighted, token by token; that is no error.
suppress_warnings = ["misc.highlighting_failure"]
