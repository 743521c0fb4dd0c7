"""The one way the lessons print a table of results."""

from typing import Iterable, Sequence


def text_table(header: Sequence[str], rows: Iterable[Sequence], title: str = "") -> str:
    """``rows`` under ``header``, columns as wide as their widest cell, numbers aligned right.
    Cells are shown with ``str``: format a number first to choose its digits."""
    body = [[str(c) for c in row] for row in rows]
    cells = [list(map(str, header)), *body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    right = [all(row[i][:1] in set("0123456789+-.") for row in body) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right))
             .rstrip() for row in cells]
    return "\n".join([title] * bool(title) + lines)
