"""Progress bars of the management commands, drawn by tqdm.

On a terminal the bar redraws one line in place; into a file or a pipe it is off, so logs
get the command's own summary line instead of a stream of carriage returns.
"""
from __future__ import annotations

from typing import TextIO

from django.core.management.base import OutputWrapper
from tqdm import tqdm


def progress_bar(total: int, label: str, stream: TextIO | OutputWrapper) -> tqdm:
    """A bar counting `total` rows on `stream` (a command's stderr); use it as a context
    manager and pass its `update` to callbacks such as ``Pool.add_many(progress=...)``."""
    out = stream._out if isinstance(stream, OutputWrapper) else stream  # tqdm writes "\r" itself
    return tqdm(total=total, desc=label, file=out, unit=" rows", disable=not out.isatty(), mininterval=0.1,
                dynamic_ncols=True)
