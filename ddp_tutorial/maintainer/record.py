"""Numbers that change from run to run live in one file, written by the command that measures them.

``--record FILE`` (``python -m ddp_tutorial.bench``, ``python -m ddp_tutorial.maintainer``) puts
what the command printed into its own section of FILE (``docs/measured.md``), with the command, the
date, the commit and the machine; the next run of the same command replaces that section.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

BEGIN, END = "<!-- measured: {} -->", "<!-- end: {} -->"


def machine() -> str:
    """One line: cores, OS, Python, torch (read from its metadata: no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return (f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch}")


def commit(cwd: Path = Path(__file__).resolve().parents[2]) -> str:
    """The kit's commit (``+changes`` when its tracked files differ), or ``unknown``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        if not head:
            return "unknown"
        return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def section(command: str, text: str) -> str:
    """The section for ``command``'s output ``text``, between its markers."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join([
        BEGIN.format(command), f"### `{command}`", "",
        f"{when}, commit {commit()}; {machine()}. Written by the command itself (`--record`).",
        "", "```text", text.rstrip("\n"), "```", END.format(command)])


def record(path, argv: Sequence[str], text: str) -> Path:
    """Replace (or add, at the end) the section of ``path`` for the command ``argv`` (without
    ``--record FILE``) with ``text``; returns the file's path."""
    command = " ".join(["python -m", *_without_record(argv)])
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    new = section(command, text)
    begin, end = BEGIN.format(command), END.format(command)
    if begin in old and end in old[old.index(begin):]:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1]
        out = head + new + tail
    else:
        out = old.rstrip("\n") + ("\n\n" if old else "") + new + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(out)
    os.replace(tmp, path)
    return path


def _without_record(argv: Sequence[str]) -> list:
    """``argv`` without ``--record FILE`` (or ``--record=FILE``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--record":
            skip = True
        elif not arg.startswith("--record="):
            out.append(arg)
    return out


@contextlib.contextmanager
def recording(path: Optional[str], argv: Sequence[str]):
    """Print as usual; with a ``path``, also ``record`` what was printed once the block ends."""
    if not path:
        yield
        return
    printed, out = io.StringIO(), sys.stdout

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            printed.write(text)
            return out.write(text)

        def flush(self) -> None:
            out.flush()

    with contextlib.redirect_stdout(Tee()):
        yield
    print(f"recorded in {record(path, argv, printed.getvalue())}", flush=True)


def main(module: str, parser, body, argv: Optional[Sequence[str]] = None) -> int:
    """``body(parser, args)`` with ``argv`` parsed by ``parser`` plus ``--record FILE``, recording
    what it prints as the command ``python -m module ARGV``."""
    parser.add_argument("--record", metavar="FILE", help="also write what this prints into its "
                        "section of FILE (docs/measured.md), with the date and commit")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    with recording(args.record, [module, *argv]):
        return body(parser, args)
