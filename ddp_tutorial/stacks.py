"""Where was each rank? The Python stacks ranks write when a launch stops them.

When ``launch``'s deadline passes, it asks every rank for its stacks
(``envvars.stacks_signal()``), waits until each has written them, and only then stops
the ranks: each rank's bootstrap has ``faulthandler`` write every thread's Python stack
(``rank/bootstrap.py``, ``RankNotes``). This module turns those notes into what a
learner needs: the main thread's stack from the script on, and the
``torch.distributed`` call it was waiting in. Standard library only (kernel side).
"""

from __future__ import annotations

import linecache
import re
from typing import Dict, List, Optional, Tuple

from ddp_tutorial import runfolder

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
#: What ``waiting_in`` says of a rank blocked in an async collective's ``Work.wait()``.
ASYNC_WAIT = "Work.wait (an async collective's handle)"
#: What it says of a rank blocked in ``torch.futures.Future.wait()`` (a Python frame of torch/futures):
#: a future made by the script itself, or one a collective's work handed on, completes only when someone
#: sets its result; no process group's timeout applies to it.
FUTURE_WAIT = "Future.wait (a torch.futures.Future)"
_FUTURES = "torch/futures/__init__.py"
_WAIT_CALL = re.compile(r"(?<!\bos)\.wait\(")  # not os.wait(): that waits for a child process
#: Frames of the machinery that starts a rank, left out of what a learner reads.
_MACHINERY = ("/rank/bootstrap.py", "/runpy.py", "<frozen runpy>")


def _starts_the_rank(frame: Tuple[str, str, str]) -> bool:
    """Whether ``frame`` is the bootstrap's ``run_rank``: below it (cold or warm) only machinery runs."""
    return frame[0].endswith("/rank/bootstrap.py") and frame[2] == "run_rank"


def _threads(text: str) -> List[Tuple[str, List[Tuple[str, str, str]]]]:
    """faulthandler's dump as [(header, [(file, line, function), ...]), ...], most recent call first."""
    threads: List[Tuple[str, List[Tuple[str, str, str]]]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append((line.rstrip(":").strip(), []))
        elif threads and _FRAME.match(line):
            m = _FRAME.match(line)
            threads[-1][1].append((m["file"], m["line"], m["func"].strip()))
    return threads


def _main_thread(text: str) -> List[Tuple[str, str, str]]:
    """The frames of the thread that runs the script, from the script on: the thread that holds ``run_rank``."""
    threads = _threads(text)
    for _, frames in threads:
        starts = [i for i, f in enumerate(frames) if _starts_the_rank(f)]
        if starts:
            return frames[:starts[0]]
    current = [frames for header, frames in threads if header.lower().startswith("current")]
    return current[0] if current else (threads[0][1] if threads else [])


def wrote_script_stack(text: str) -> bool:
    """Whether a dump (perhaps still being written) holds the script's whole stack: the thread that
    runs the script has reached the frames that start the rank, which come after the script's."""
    return any(_starts_the_rank(f) for _, frames in _threads(text) for f in frames)


def script_stack(text: str) -> str:
    """The main thread's stack from the script on, most recent call first, as faulthandler prints it."""
    frames = [f for f in _main_thread(text) if not any(m in f[0] for m in _MACHINERY)]
    if not frames:
        return "(no Python frames)"
    return "\n".join(f'  File "{file}", line {line} in {func}' for file, line, func in frames)


def waiting_in(text: str) -> Optional[str]:
    """The ``torch.distributed`` call the script was inside, e.g. ``"all_reduce"``; None if none.

    The outermost frame in ``distributed_c10d.py`` is the collective the script called
    (inner frames are its helpers); else the outermost frame of DDP or torch.distributed; a
    ``torch.futures.Future.wait`` is named as such; else, a script line that calls ``.wait()`` with no
    frame of torch under it, a ``Work.wait`` (C++, no Python frame).
    """
    frames = list(reversed(_main_thread(text)))  # outermost first
    if frames and frames[-1][0].replace("\\", "/").endswith(_FUTURES) and frames[-1][2] == "wait":
        return FUTURE_WAIT
    for file, _, func in frames:
        if file.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py"):
            return func
    for file, _, func in frames:
        path = file.replace("\\", "/")
        if "/torch/distributed/" in path or path.endswith("torch/nn/parallel/distributed.py"):
            return func
    # An async collective's handle (``work = dist.all_reduce(t, async_op=True)``) waits in C++:
    # no Python frame of torch, only the script's line that calls ``.wait()``.
    if frames and _WAIT_CALL.search(linecache.getline(frames[-1][0], int(frames[-1][1]))):
        return ASYNC_WAIT
    return None


def rank_stacks(run_dir, attempt: int, ranks) -> Dict[int, str]:
    """rank -> its script's stack at the moment it was stopped, for each of ``ranks``."""
    notes = runfolder.stack_notes(run_dir, attempt)
    return {r: (script_stack(notes[r]) if r in notes else
                "(no stack: the rank did not write one when asked or stopped; a script with its own "
                "handler for those signals, or a rank stopped before it could, leaves none)") for r in ranks}


def rank_waits(run_dir, attempt: int, ranks) -> Dict[int, Optional[str]]:
    """rank -> the torch.distributed call it was inside when stopped (None: none, or no stack)."""
    notes = runfolder.stack_notes(run_dir, attempt)
    return {r: (waiting_in(notes[r]) if r in notes else None) for r in ranks}


def format_stacks(stacks: Dict[int, str], waits: Dict[int, Optional[str]]) -> str:
    """All ranks' stacks, one block each, headed by where the rank was waiting."""
    blocks = []
    for rank in sorted(stacks):
        where = (f"inside torch.distributed.{waits[rank]}" if waits.get(rank)
                 else "not inside a torch.distributed call")
        blocks.append(f"--- rank {rank}, {where} (most recent call first) ---\n{stacks[rank]}")
    return "\n".join(blocks)
