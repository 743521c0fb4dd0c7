"""Where was each rank? At a launch's deadline, ``faulthandler`` writes every rank's stacks
(``rank/bootstrap.py``); this gives the main thread's stack from the script on, and the
``torch.distributed`` call it was waiting in. Standard library only (kernel side)."""

from __future__ import annotations

import linecache
import re
from typing import Dict, List, Optional, Tuple

from ddp_tutorial import runfolder

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
#: What ``waiting_in`` says of a rank blocked in an async collective's ``Work.wait()``.
ASYNC_WAIT = "Work.wait (an async collective's handle)"
#: What it says of a rank blocked in ``torch.futures.Future.wait()``: such a future completes only
#: when someone sets its result; no process group's timeout applies to it.
FUTURE_WAIT = "Future.wait (a torch.futures.Future)"
_FUTURES = "torch/futures/__init__.py"
_WAIT_CALL = re.compile(r"(?<!\bos)\.wait\(")  # not os.wait(): that waits for a child process
#: Frames of the machinery that starts a rank, left out of what a learner reads.
_MACHINERY = ("/rank/bootstrap.py", "/runpy.py", "<frozen runpy>")
Frame = Tuple[str, str, str]  # (file, line, function)


def _starts_the_rank(frame: Frame) -> bool:
    """Whether ``frame`` is the bootstrap's ``run_rank``: below it only machinery runs."""
    return frame[0].endswith("/rank/bootstrap.py") and frame[2] == "run_rank"


def _threads(text: str) -> List[Tuple[str, List[Frame]]]:
    """faulthandler's dump as [(header, [frame, ...]), ...], innermost frame first."""
    threads: List[Tuple[str, List[Frame]]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append((line.rstrip(":").strip(), []))
        elif threads and (m := _FRAME.match(line)):
            threads[-1][1].append((m["file"], m["line"], m["func"].strip()))
    return threads


def _main_thread(text: str) -> List[Frame]:
    """The frames, from the script on, of the thread that runs it (the one holding ``run_rank``)."""
    threads = _threads(text)
    for _, frames in threads:
        starts = [i for i, f in enumerate(frames) if _starts_the_rank(f)]
        if starts:
            return frames[:starts[0]]
    current = [frames for header, frames in threads if header.lower().startswith("current")]
    return current[0] if current else (threads[0][1] if threads else [])


def wrote_script_stack(text: str) -> bool:
    """Whether a dump (perhaps still being written) holds the script's whole stack: it has reached
    the frames that start the rank, which come after the script's."""
    return any(_starts_the_rank(f) for _, frames in _threads(text) for f in frames)


def script_stack(text: str) -> str:
    """The main thread's stack from the script on, innermost first, as faulthandler prints it."""
    frames = [f for f in _main_thread(text) if not any(m in f[0] for m in _MACHINERY)]
    if not frames:
        return "(no Python frames)"
    return "\n".join(f'  File "{file}", line {line} in {func}' for file, line, func in frames)


def waiting_in(text: str) -> Optional[str]:
    """The ``torch.distributed`` call the script was inside (``"all_reduce"``, ``FUTURE_WAIT``...),
    or None: the outermost frame in ``distributed_c10d.py`` (inner ones are its helpers); else a
    script line calling ``.wait()`` with no torch frame below is a ``Work.wait`` (C++)."""
    frames = list(reversed(_main_thread(text)))  # outermost first
    if frames and frames[-1][0].endswith(_FUTURES) and frames[-1][2] == "wait":
        return FUTURE_WAIT
    c10d = [f for file, _, f in frames if file.endswith("torch/distributed/distributed_c10d.py")]
    dist = [f for file, _, f in frames
            if "/torch/distributed/" in file or file.endswith("torch/nn/parallel/distributed.py")]
    if c10d or dist:
        return (c10d or dist)[0]
    if frames and _WAIT_CALL.search(linecache.getline(frames[-1][0], int(frames[-1][1]))):
        return ASYNC_WAIT
    return None


def rank_stacks(run_dir, attempt: int, ranks) -> Tuple[Dict[int, str], Dict[int, Optional[str]]]:
    """For each of ``ranks``: its script's stack when it was stopped, and the torch.distributed
    call it was inside (None: none, or no stack)."""
    notes = runfolder.stack_notes(run_dir, attempt)
    missing = ("(no stack: the rank did not write one when asked or stopped; a script with its "
               "own handler for those signals, or a rank stopped before it could, leaves none)")
    return ({r: script_stack(notes[r]) if r in notes else missing for r in ranks},
            {r: waiting_in(notes[r]) if r in notes else None for r in ranks})


def format_stacks(stacks: Dict[int, str], waits: Dict[int, Optional[str]]) -> str:
    """All ranks' stacks, one block each, headed by where the rank was waiting."""
    blocks = []
    for rank in sorted(stacks):
        where = (f"inside torch.distributed.{waits[rank]}" if waits.get(rank)
                 else "not inside a torch.distributed call")
        blocks.append(f"--- rank {rank}, {where} (most recent call first) ---\n{stacks[rank]}")
    return "\n".join(blocks)
