"""A dependency-free progress bar for management commands.

On a terminal it redraws one line in place (``\\r``); into a file or a pipe it writes
only the final line, so logs get one line per run instead of hundreds.
"""
from __future__ import annotations

import sys
import time
from functools import partial
from types import TracebackType
from typing import Callable, TextIO

from django.core.management.base import OutputWrapper


class Progress:
    """Count work done towards `total` and show it on `stream` (default stderr).

    ``with Progress(len(rows), "importing") as bar: ... bar.advance(n)``; `advance` fits
    callbacks such as ``Pool.add_many(progress=bar.advance)``.
    """

    #: Seconds between redraws on a terminal: a per-item callback must not flood it.
    REDRAW = 0.1

    def __init__(
        self,
        total: int,
        label: str = "",
        stream: TextIO | OutputWrapper | None = None,
        width: int = 30,
    ) -> None:
        self.total = max(0, total)
        self.label = label
        self.done = 0
        self.width = width
        stream = sys.stderr if stream is None else stream
        self._tty = stream.isatty()
        self._flush = stream.flush
        # Django's OutputWrapper appends a newline to every write unless told otherwise.
        self._write: Callable[[str], object] = (
            partial(stream.write, ending="") if isinstance(stream, OutputWrapper) else stream.write
        )
        self._drawn_at = float("-inf")

    def __enter__(self) -> Progress:
        if self._tty:
            self._draw()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        line = self.line() + ("" if kind is None else " (interrupted)")
        self._write(("\r" if self._tty else "") + line + "\n")
        self._flush()

    def advance(self, n: int = 1) -> None:
        """Count `n` more items done; redraws at most every `REDRAW` seconds."""
        self.done += n
        if self._tty and time.monotonic() - self._drawn_at >= self.REDRAW:
            self._draw()

    def line(self) -> str:
        """The bar as text, e.g. ``importing [######    ] 60% 600/1000``."""
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * self.width)
        bar = "#" * filled + " " * (self.width - filled)
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}[{bar}] {int(fraction * 100):3d}% {self.done}/{self.total}"

    def _draw(self) -> None:
        self._write("\r" + self.line())
        self._flush()
        self._drawn_at = time.monotonic()
