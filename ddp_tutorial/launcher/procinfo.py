"""What a process is, asked of psutil: the one place the kit asks. A process that exits while
asked about answers None (or is left out), never raises; a zombie counts as gone."""

from __future__ import annotations

import os
from typing import List, Optional

import psutil


def _ask(pid: int, question):
    """``question(psutil.Process(pid))``, or None if the process is gone or not ours to read."""
    try:
        return question(psutil.Process(pid))
    except (psutil.Error, OSError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, exited but not yet reaped, is not)."""
    return _ask(pid, lambda p: p.status()) not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def group(pid: int) -> Optional[int]:
    """The process group of ``pid`` (POSIX), None once it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def group_members(pgid: int) -> List[int]:
    """Processes of group ``pgid`` still running (not zombies), its leader aside."""
    return [pid for pid in psutil.pids() if pid != pgid and group(pid) == pgid and alive(pid)]
