"""Lesson helpers shared by several notebooks; each notebook (or pair) has its folder beside this.
They run in the notebook kernel and import no torch; each ``workers/`` folder holds the scripts
its lesson starts on the ranks with ``launch``."""

from __future__ import annotations

import __future__
import ast
import contextlib
import difflib
import re
import socket
from typing import Dict, Iterator, List, Optional, Sequence

import psutil

from ddp_tutorial import config, mistakes as catalogue
from ddp_tutorial.launcher import BOOTSTRAP
from ddp_tutorial.lessons.table import text_table
from ddp_tutorial.runfolder import Run

# -- Notebook 00: the original demo's mistakes -----------------------------------
def format_mistakes() -> str:
    """The original demo's mistakes as a text table: name, notebook, what goes wrong."""
    return text_table(["mistake", "notebook", "what goes wrong"],
                      [(m.name, m.notebooks, m.what) for m in catalogue.MISTAKES])


def mistakes_markdown() -> str:
    """The mistakes as the README's Markdown table; a test keeps the README's copy equal to it."""
    lines = ["| mistake | what goes wrong | the fix | measured in notebook |",
             "| --- | --- | --- | --- |"]
    for m in catalogue.MISTAKES:
        name = f"`--bug {m.name}`" if m.function else f"`{m.name}` (no `--bug`: how it is launched)"
        lines.append(f"| {name} | {m.what} | {m.fix} | {m.notebooks} |")
    return "\n".join(lines)


def rank_results(run, part: Optional[str] = None) -> Dict[int, List[dict]]:
    """Per rank, the records its script reported (only those of ``part``, if given)."""
    return {rank: [rec for rec in run.results(rank) if part is None or rec.get("part") == part]
            for rank in range(run.world_size)}


# -- A rank's error line; a script's code, read without running it in the kernel --
_ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception): .*|what\(\): .*)")


def headline(lines: Sequence[str]) -> Optional[str]:
    """The last line of a rank's output that states an error (Python's or a C++ ``what():``)."""
    return next((line.strip() for line in reversed(lines) if _ERROR_LINE.match(line)), None)


def error_line(err) -> Optional[str]:
    """The ``headline`` of the first failing rank's traceback in a ``WorkerError``."""
    return headline(err.traceback.splitlines())


def _definition(path: str, name: str):
    """(the text of script ``path``, the node of its function or class ``name``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return text, node
    raise ValueError(f"no function {name!r} in {path}")


def script_source(path: str, name: str) -> str:
    """The source of function (or class) ``name`` in the script ``path``, read: importing it would
    import torch in the kernel."""
    return ast.get_source_segment(*_definition(path, name))


def script_function(path: str, name: str):
    """Pure function ``name`` of script ``path``, compiled from its source alone: the kernel runs
    the ranks' code without torch. One that needs a module global raises NameError when called."""
    namespace: Dict[str, object] = {}
    code = compile(script_source(path, name), path, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # only the def: it defines the function and runs nothing else
    return namespace[name]


ORIGINAL_SCRIPT = catalogue.ORIGINAL_SCRIPT
# typing's List[int] in one file and list[int] in the other mean the same: not a change to show
_TYPING = re.compile(r"\b(List|Dict|Tuple|Set)\[")


def mistake_diff(name: str) -> str:
    """The original's function against train.py's fix as a unified diff, docstrings left out;
    ``name``: a ``--bug`` name ("forward-outside-no-sync") or the function it replaces."""
    replaced = catalogue.BUGS
    function = replaced.get(name, name)
    if function not in replaced.values():
        raise ValueError(f"no original version of {name!r}: give a --bug name {sorted(replaced)} "
                         f"or a function {sorted(replaced.values())}")
    sides = [_code_lines(path, function) for path in (ORIGINAL_SCRIPT, config.TRAIN_SCRIPT)]
    return "".join(difflib.unified_diff(*sides, f"original.{function}", f"train.{function}"))


def _code_lines(path: str, function: str) -> List[str]:
    """The whole lines of ``function`` in ``path``, without docstring, typing spelled one way."""
    text, node = _definition(path, function)
    first = node.body[0]
    drop = range(first.lineno - 1, first.end_lineno) if ast.get_docstring(node) else range(0)
    lines = text.splitlines()
    return [_TYPING.sub(lambda m: m.group(1).lower() + "[", lines[i]) + "\n"
            for i in range(node.lineno - 1, node.end_lineno) if i not in drop]


# -- What a launch leaves behind (notebooks 01 and 05) ----------------------------
def worker_alive(pid: int) -> bool:
    """Is ``pid`` still a running launcher worker (not just any process that reused the pid)?"""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        words = process.cmdline()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # alive, but not ours to read
        return True
    # A cold rank runs the bootstrap; a warm one, forked, shows the forkserver's command line.
    return BOOTSTRAP in words or any("multiprocessing.forkserver" in w for w in words)


def port_can_be_bound(port: int, host: str = "127.0.0.1") -> bool:
    """Can a new server listen on ``port`` now? With SO_REUSEADDR (``create_server`` sets it on
    POSIX, as TCPStore does): connections in TIME_WAIT do not block it, a listening process does."""
    try:
        socket.create_server((host, port)).close()
    except OSError:
        return False
    return True


def leftovers(run: Run) -> Dict[str, object]:
    """After a launch: worker pids still alive, and whether its master port is free again."""
    return {"pids": list(run.pids), "alive_pids": [pid for pid in run.pids if worker_alive(pid)],
            "master_port": run.master_port, "port_free": port_can_be_bound(run.master_port)}


@contextlib.contextmanager
def hold_port(host: str = "127.0.0.1") -> Iterator[int]:
    """Listen on a free port during the ``with`` block, as a job that still runs would."""
    with socket.create_server((host, 0)) as s:
        yield s.getsockname()[1]
