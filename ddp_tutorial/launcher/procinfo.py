"""What a process is, asked of psutil: the one place the kit asks. A process that exits while
asked about answers None (or is left out), never raises; a zombie counts as gone."""

from __future__ import annotations

import os
from typing import List, Optional

import psutil


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, exited but not yet reaped, is not)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.Error, OSError):  # gone, or not ours to read
        return False


def group(pid: int) -> Optional[int]:
    """The process group of ``pid`` (POSIX), None once it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def group_members(pgid: int) -> List[int]:
    """Processes of group ``pgid`` still running (not zombies), its leader aside."""
    return [pid for pid in psutil.pids() if pid != pgid and group(pid) == pgid and alive(pid)]
