"""Lesson helpers shared by several notebooks; each notebook (or pair) has its own module beside this.

Who runs where, from the names alone: the modules in ``lessons/`` run in the
notebook kernel and import no torch; each ``workers/`` folder holds the scripts
its lesson starts on the ranks with ``launch``.

    lessons/                  this module: the original's mistakes (00), reading scripts, leftovers
    lessons/init_wrap/        notebooks 01-02: init_process_group, the DDP wrap
    lessons/sampler_accumulation/        notebooks 03-04: DistributedSampler, no_sync accumulation
    lessons/teardown/         notebook 05: destroy_process_group, crashes, leftovers
    lessons/performance/      notebook 07: the performance lab, also python -m ddp_tutorial.bench
    lessons/beyond_one_machine/           notebook 08: uneven inputs with Join, the GPU check
    lessons/pitfalls/         notebook 09: the pitfalls lab
    lessons/sharding/         notebook 10: memory, ZeRO-1, FSDP2, compressed gradients
    lessons/build_ddp/        notebook 11: DDP built by hand, measured against torch's
"""

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
    """The original demo's mistakes (``mistakes.MISTAKES``) as a text table: name, notebook, what
    goes wrong."""
    return text_table(["mistake", "notebook", "what goes wrong"],
                      [(m.name, m.notebooks, m.what) for m in catalogue.MISTAKES])


def mistakes_markdown() -> str:
    """The mistakes as the README's Markdown table; a test keeps the README's copy equal to it."""
    lines = ["| mistake | what goes wrong | the fix | measured in notebook |", "| --- | --- | --- | --- |"]
    for m in catalogue.MISTAKES:
        name = f"`--bug {m.name}`" if m.function else f"`{m.name}` (no `--bug`: how it is launched)"
        lines.append(f"| {name} | {m.what} | {m.fix} | {m.notebooks} |")
    return "\n".join(lines)


# -- Per-rank results of a lesson script ------------------------------------------
def rank_results(run, part: Optional[str] = None) -> Dict[int, List[dict]]:
    """Per rank, the records its script reported (only those of ``part``, if given)."""
    return {rank: [rec for rec in run.results(rank) if part is None or rec.get("part") == part]
            for rank in range(run.world_size)}


# -- Show a lesson script's code without running it in the kernel ----------------
_ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception): .*|what\(\): .*)")


def headline(lines: Sequence[str]) -> Optional[str]:
    """The last line of a rank's output that states an error (Python's or a C++ ``what():``)."""
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line.strip()
    return None


def error_line(err) -> Optional[str]:
    """What the first failing rank of a ``WorkerError`` said its error was: its traceback's ``headline``."""
    return headline(err.traceback.splitlines())


def script_source(path: str, name: str) -> str:
    """The source of function (or class) ``name`` in the script file ``path``, read, not imported.

    Importing a lesson script would import torch (and run its top-level code) in
    the notebook kernel; reading it costs nothing.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_source_segment(text, node)
    raise ValueError(f"no function {name!r} in {path}")


def script_function(path: str, name: str):
    """Function ``name`` of the script file ``path``, compiled from its source alone, not imported.

    For a script's pure functions (arguments in, a value out: no imports, no module globals),
    so the kernel runs the very code the ranks run without importing the script (and torch).
    Annotations are kept as text. A function that needs a global raises NameError when called.
    """
    namespace: Dict[str, object] = {}
    code = compile(script_source(path, name), path, "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    exec(code, namespace)  # only the def: it defines the function and runs nothing else
    return namespace[name]


ORIGINAL_SCRIPT = catalogue.ORIGINAL_SCRIPT
# typing's List[int] in one file and list[int] in the other mean the same: not a change to show
_TYPING = re.compile(r"\b(List|Dict|Tuple|Set)\[")


def mistake_diff(name: str) -> str:
    """The original's version of a function against train.py's fix, as a unified diff (``-`` original, ``+`` fix).

    Both files are read, not imported; docstrings are left out, and typing's spellings are made
    the same on both sides (``List[bool]`` and ``list[bool]``), so only the changes that matter show.

    Args:
        name: a ``--bug`` name ("forward-outside-no-sync") or the function it replaces ("micro_step").
    """
    replaced = catalogue.BUG_FUNCTIONS
    function = replaced.get(name, name)
    if function not in replaced.values():
        raise ValueError(f"no original version of {name!r}: give a --bug name {sorted(replaced)} "
                         f"or a function {sorted(replaced.values())}")
    sides = [_code_lines(path, function) for path in (ORIGINAL_SCRIPT, config.TRAIN_SCRIPT)]
    return "".join(difflib.unified_diff(*sides, f"original.{function}", f"train.{function}"))


def _code_lines(path: str, function: str) -> List[str]:
    """Function ``function`` of the file ``path``: its whole lines (a last line's comment too),
    without the docstring, typing spelled one way."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function)
    first = node.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    drop = range(first.lineno - 1, first.end_lineno) if is_doc else range(0)
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
    # A cold rank runs the bootstrap; a warm one shows the forkserver's command line, forked from it.
    return BOOTSTRAP in words or any("multiprocessing.forkserver" in w for w in words)


def port_can_be_bound(port: int, host: str = "127.0.0.1") -> bool:
    """Can a new server listen on ``port`` now, as the next rendezvous store would?

    SO_REUSEADDR, as TCPStore sets it: closed connections lingering in
    TIME_WAIT do not block a new listener, a process still listening does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return False
    return True


def leftovers(run: Run) -> Dict[str, object]:
    """After a launch: worker pids still alive, and whether its master port is free again."""
    return {"pids": list(run.pids), "alive_pids": [pid for pid in run.pids if worker_alive(pid)],
            "master_port": run.master_port, "port_free": port_can_be_bound(run.master_port)}


@contextlib.contextmanager
def hold_port(host: str = "127.0.0.1") -> Iterator[int]:
    """Listen on a free port for the duration of the ``with`` block, as a job that still runs would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen()
        yield s.getsockname()[1]
