"""What a process is, asked of psutil: the one place the kit asks.

psutil answers on Linux, macOS and Windows alike. A process can exit at any moment
while it is asked about: each question here then answers None (or leaves the process
out), never raises. A zombie (exited, not yet reaped) counts as gone. An answer is a
moment's truth: a pid can be reused once its process is reaped.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import psutil

#: What psutil raises about a process that exited, is a zombie, or is not ours to read.
_GONE = (psutil.Error, OSError)


def _ask(pid: int, question):
    """``question(psutil.Process(pid))``, or None if the process is gone or not ours."""
    try:
        return question(psutil.Process(pid))
    except _GONE:
        return None


def pids() -> List[int]:
    """Every process's pid now."""
    return psutil.pids()


def state(pid: int) -> Optional[str]:
    """psutil's status: ``"running"``, ``"sleeping"``, ``"zombie"``, ...; None once it is reaped."""
    return _ask(pid, lambda p: p.status())


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, exited but not yet reaped, is not)."""
    return state(pid) not in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def group(pid: int) -> Optional[int]:
    """The process group of ``pid`` (POSIX)."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def cmdline(pid: int) -> Optional[List[str]]:
    """The argv of ``pid``; None if it is gone (a zombie's is empty: None too)."""
    return _ask(pid, lambda p: p.cmdline()) or None


def pids_with_env(name: str, value: str, prefix: bool = False) -> List[int]:
    """Live processes, this one aside, whose variable ``name`` is ``value`` (or starts with it)."""
    found = []
    for pid in pids():
        env = _ask(pid, lambda p: p.environ()) if pid != os.getpid() else None
        got = (env or {}).get(name)
        if got is not None and (got.startswith(value) if prefix else got == value) and alive(pid):
            found.append(pid)
    return found


def uid(pid: int) -> Optional[int]:
    """The real user id ``pid`` runs as."""
    return _ask(pid, lambda p: p.uids().real)


def threads(pid: int) -> Optional[int]:
    """How many OS threads ``pid`` has."""
    return _ask(pid, lambda p: p.num_threads())


def memory_kb(pid: int) -> Optional[Dict[str, Optional[int]]]:
    """``{"rss": kB, "pss": kB or None}``: resident memory of ``pid`` and its proportional share
    (None where the OS does not say, e.g. macOS); None if it is gone."""
    def read(p):
        try:
            full = p.memory_full_info()
        except psutil.AccessDenied:
            full = None
        pss = getattr(full, "pss", None)
        return {"rss": p.memory_info().rss // 1024, "pss": None if pss is None else pss // 1024}

    return _ask(pid, read)


def group_members(pgid: int) -> List[int]:
    """Processes of group ``pgid`` still running (not zombies), its leader aside."""
    return [pid for pid in pids() if pid != pgid and group(pid) == pgid and alive(pid)]
