"""Input files of the operator commands: one entry per line, `#` comments allowed."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from django.core.management.base import CommandError


def entries(path: str) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of each non-blank, non-comment line of `path`.

    An unreadable file is bad input: a one-line CommandError with exit code 2.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {path}: {exc}", returncode=2) from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            yield number, line


def bad_line(path: str, number: int, line: str, problem: object) -> CommandError:
    """The error for a malformed line: file, line number, what is wrong, the line."""
    return CommandError(f"{path}, line {number}: {problem}: {line[:80]!r}", returncode=2)
