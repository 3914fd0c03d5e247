"""A Sphinx directive that documents a management command from its own argument parser.

    ```{django-command} lease
    ```

builds the parser as `manage.py lease --help` does (Django's
``load_command_class(app, name).create_parser("manage.py", name)``) and renders the list
of its sub-commands, its help, then each sub-command's, so the reference cannot drift
from the code. When the build
ends, every command of the django-leases apps must have been rendered somewhere: a
command added without its reference is a warning, an error under ``-W``.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from django.core.management import get_commands, load_command_class
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

log = logging.getLogger(__name__)

#: Width of the rendered help, whatever terminal the build runs in.
COLUMNS = "88"
#: The apps whose commands must all be documented.
APPS = ("leases", "leases.tasks", "leases.pipelines")


def parser_of(name: str) -> argparse.ArgumentParser:
    """The command's parser, as `manage.py NAME --help` builds it."""
    app = get_commands()[name]
    return load_command_class(app, name).create_parser("manage.py", name)


def sub_parsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser's sub-commands in the order they were added, nested ones after their own."""
    found = []
    for action in parser._actions:  # argparse keeps no public list of sub-commands
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found.append((sub_name, sub))
                found += [(f"{sub_name} {deeper}", parser) for deeper, parser in sub_parsers(sub)]
    return found


def help_text(parser: argparse.ArgumentParser) -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        return parser.format_help().rstrip()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


class DjangoCommand(SphinxDirective):
    """The help of `manage.py NAME`, then of each of its sub-commands."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        if name not in get_commands():
            raise self.error(f"no management command named {name!r}")
        parser = parser_of(name)
        self.env.domaindata.setdefault("django_commands", {})[name] = self.env.docname
        subs = sub_parsers(parser)
        found: list[nodes.Node] = [self._listing(name, [sub_name for sub_name, _ in subs])] if subs else []
        found.append(self._block(help_text(parser)))
        for sub_name, sub in subs:
            found.append(nodes.rubric(text=f"manage.py {name} {sub_name}"))
            found.append(self._block(help_text(sub)))
        return found

    @staticmethod
    def _listing(name: str, subs: list[str]) -> nodes.paragraph:
        """"Sub-commands: add, import, ..." from the parser, so the list cannot drift either."""
        paragraph = nodes.paragraph(text=f"Sub-commands of manage.py {name}: ")
        for index, sub in enumerate(subs):
            paragraph += nodes.literal(text=sub)
            paragraph += nodes.Text(", " if index < len(subs) - 1 else ".")
        return paragraph

    @staticmethod
    def _block(text: str) -> nodes.literal_block:
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return block


def _merge(app: Sphinx, env: Any, docnames: Any, other: Any) -> None:
    env.domaindata.setdefault("django_commands", {}).update(other.domaindata.get("django_commands", {}))


def _purge(app: Sphinx, env: Any, docname: str) -> None:
    documented = env.domaindata.setdefault("django_commands", {})
    for name in [name for name, doc in documented.items() if doc == docname]:
        del documented[name]


def _check_all(app: Sphinx, env: Any) -> None:
    documented = env.domaindata.get("django_commands", {})
    ours = sorted(name for name, owner in get_commands().items() if owner in APPS)
    for name in ours:
        if name not in documented:
            log.warning("management command %r of %s has no ```{django-command} %s``` in the docs",
                        name, get_commands()[name], name)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("django-command", DjangoCommand)
    app.connect("env-merge-info", _merge)
    app.connect("env-purge-doc", _purge)
    app.connect("env-check-consistency", _check_all)
    return {"version": "1", "env_version": 1, "parallel_read_safe": True, "parallel_write_safe": True}
