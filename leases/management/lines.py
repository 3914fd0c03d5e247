"""Input files of the operator commands: one entry per line, `#` comments allowed."""
from __future__ import annotations

from collections.abc import Iterator

from django.core.management.base import CommandError

#: Longest line accepted, in bytes without its line ending. The file is read a line at
#: a time, so a file without line breaks (`/dev/zero`, a binary) ends here instead of
#: filling memory.
MAX_LINE = 64 * 1024


def entries(path: str) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of each non-blank, non-comment line of `path`.

    The file is UTF-8, with or without a byte order mark (spreadsheets write one), and is
    streamed. An unreadable file, text that is not UTF-8 or a line longer than MAX_LINE
    bytes is bad input: a one-line CommandError with exit code 2.
    """
    try:
        with open(path, "rb") as file:
            for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE + 2), b""), 1):
                body = raw.rstrip(b"\r\n")
                if len(body) > MAX_LINE:
                    raise CommandError(f"{path}, line {number}: longer than {MAX_LINE} bytes", returncode=2)
                try:
                    line = body.decode("utf-8-sig" if number == 1 else "utf-8").strip()
                except UnicodeDecodeError as exc:
                    problem = f"not UTF-8 text: {exc}"
                    raise CommandError(f"{path}, line {number}: {problem}", returncode=2) from None
                if line and not line.startswith("#"):
                    yield number, line
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc}", returncode=2) from None


def bad_line(path: str, number: int, line: str, problem: object) -> CommandError:
    """The error for a malformed line: file, line number, what is wrong, the line."""
    return CommandError(f"{path}, line {number}: {problem}: {line[:80]!r}", returncode=2)
