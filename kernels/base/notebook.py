"""What the notebooks share: printing a part of a kernel's source.

A chapter shows its kernel a piece at a time, next to the text that explains that piece:
``show_source(make_stream_k, "for g in range(", "`last` is rewritten")`` prints the lines
of the function's source from the first line containing the one marker to the first line
after it containing the other (and ``more`` lines beyond).
"""

from __future__ import annotations

import inspect

__all__ = ["show_source"]


def show_source(fn, first: str, last: str, more: int = 0) -> None:
    """Print ``fn``'s source from the line containing ``first`` to the next line containing
    ``last`` (and ``more`` lines after it). ValueError if a marker is not found."""
    lines = inspect.getsource(fn).splitlines()
    i = next((n for n, line in enumerate(lines) if first in line), None)
    if i is None:
        raise ValueError(f"first: {first!r} is not in the source of {fn.__name__}")
    j = next((n for n, line in enumerate(lines[i:], i) if last in line), None)
    if j is None:
        raise ValueError(f"last: {last!r} does not follow {first!r} in the source of {fn.__name__}")
    print("\n".join(lines[i:j + 1 + more]))
