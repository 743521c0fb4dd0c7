"""``--record FILE`` (``python -m ddp_tutorial.bench``, ``... maintainer``): what the command
printed, in its own section of FILE (``docs/measured.md``) with the command, date, commit and
machine; the next run of the same command replaces that section."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Optional, Sequence

BEGIN, END = "<!-- measured: {} -->", "<!-- end: {} -->"


def machine() -> str:
    """One line: cores, OS, Python, torch (read from its metadata: no import)."""
    return (f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {version('torch')}")


def commit(cwd: Path = Path(__file__).resolve().parents[2]) -> str:
    """The kit's commit (``+changes`` when its tracked files differ), or ``unknown``."""
    try:
        head, changes = (subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                                        timeout=30).stdout.strip()
                         for args in (["rev-parse", "--short", "HEAD"],
                                      ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + "+changes" * bool(changes) if head else "unknown"


def record(path, argv: Sequence[str], text: str) -> Path:
    """Replace (or add, at the end) the section of ``path`` for the command ``argv`` (without
    ``--record FILE``) with ``text``; returns the file's path."""
    only_record = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    only_record.add_argument("--record")
    command = " ".join(["python -m", *only_record.parse_known_args(argv)[1]])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    new = "\n".join([
        BEGIN.format(command), f"### `{command}`", "",
        f"{when}, commit {commit()}; {machine()}. Written by the command itself (`--record`).",
        "", "```text", text.rstrip("\n"), "```", END.format(command)])
    path = Path(path)
    old = path.read_text() if path.exists() else ""
    section = re.compile(re.escape(BEGIN.format(command)) + ".*?" + re.escape(END.format(command)),
                         re.S)
    out, replaced = section.subn(lambda _: new, old, count=1)
    if not replaced:
        out = old.rstrip("\n") + ("\n\n" if old else "") + new + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(out)
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def recording(path: Optional[str], argv: Sequence[str]):
    """Print as usual; with a ``path``, also ``record`` what was printed once the block ends."""
    if not path:
        yield
        return
    out = sys.stdout

    class Tee(io.StringIO):  # keeps what is printed, and prints it
        def write(self, text: str) -> int:
            out.write(text)
            return super().write(text)

        def flush(self) -> None:
            out.flush()

    with contextlib.redirect_stdout(Tee()) as printed:
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
