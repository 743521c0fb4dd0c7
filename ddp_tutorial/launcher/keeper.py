"""The group keeper's client: what a launch started dies with the launching process.

A rank dies with its launcher by its parent-death signal, but what the rank started
does not. So each launching process starts one small keeper (``group_keeper.py``,
in a session of its own) and tells it, over a pipe, every process group it starts
(``keep``) and sweeps (``forget``). If this process dies, even by SIGKILL, the
kernel closes the pipe, and the keeper kills every group still listed.
``keep_own_group_after_exit`` is the same guard for a process's own group, for a
rank that a launcher of its own (torchrun) started in a session of its own.
Standard library only.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Optional, Set

#: The keeper: reads ``+PGID``/``-PGID`` lines, kills the groups still listed at EOF.
KEEPER_SCRIPT = str(Path(__file__).resolve().parent / "group_keeper.py")

_KEEPER: Optional[subprocess.Popen] = None
_KEEPER_OWNER: Optional[int] = None
_KEEPER_LOCK = threading.Lock()
_KEPT: Set[int] = set()  # groups told to the keeper and not yet swept
_KEPT_OWNER: Optional[int] = None  # the process that started them
_OWN_GROUP_KEEPER: List[subprocess.Popen] = []  # keep_own_group_after_exit's: its pipe stays open


def keep(pgid: int) -> None:
    """Tell the keeper that process group ``pgid`` started: it kills the group if this process dies."""
    _tell("+", pgid)


def forget(pgid: int) -> None:
    """Tell the keeper that group ``pgid`` was swept (its leader is about to be reaped)."""
    _tell("-", pgid)


def keeper_pid() -> Optional[int]:
    """The pid of this process's group keeper, if one runs."""
    if _KEEPER is not None and _KEEPER_OWNER == os.getpid() and _KEEPER.poll() is None:
        return _KEEPER.pid
    return None


def _start_keeper(stdin) -> subprocess.Popen:
    # -I -S: it starts in about 20 ms and imports nothing of the kit or of torch.
    return subprocess.Popen([sys.executable, "-I", "-S", KEEPER_SCRIPT], stdin=stdin,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _tell(sign: str, pgid: int) -> None:
    """Send ``+pgid`` or ``-pgid`` to the keeper, starting it (again) if need be.

    A new keeper is told every group still listed. Without a keeper (it cannot be
    started) launches work as before: the ranks still die with this process, only
    what they started may outlive it.
    """
    global _KEEPER, _KEEPER_OWNER, _KEPT_OWNER
    with _KEEPER_LOCK:
        if _KEPT_OWNER != os.getpid():  # we are a fork: the groups listed are our parent's
            _KEPT.clear()
            _KEPT_OWNER = os.getpid()
        (_KEPT.add if sign == "+" else _KEPT.discard)(pgid)
        line = f"{sign}{pgid}\n"
        for _ in range(2):
            if keeper_pid() is None:  # none yet, it died, or we are a fork of its owner
                try:
                    _KEEPER = _start_keeper(subprocess.PIPE)
                except OSError:
                    _KEEPER = None
                    return
                _KEEPER_OWNER = os.getpid()
                line = "".join(f"+{g}\n" for g in sorted(_KEPT))  # every listed group, this one included
            try:
                _KEEPER.stdin.write(line.encode())
                _KEEPER.stdin.flush()
                return
            except (OSError, ValueError):  # it died: start another, which gets every listed group
                _KEEPER = None


@atexit.register  # registered before the launch groups' own handler, so it runs after it
def _release_keeper() -> None:
    """At exit, after the groups were stopped: the keeper reads EOF, finds nothing left, exits."""
    if keeper_pid() is not None:
        try:
            _KEEPER.stdin.close()
            _KEEPER.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


def keep_own_group_after_exit() -> None:
    """Have a keeper kill this process's own group once this process is gone, however it ends.

    For a process that leads its group and that no keeper of ours watches (a rank
    torchrun started in a session of its own): its launcher's death takes the rank
    (parent-death signal) but not what the rank started. The keeper reads EOF when
    this process, the pipe's only holder, is gone, and kills what is left of its
    group, as ``launch`` sweeps a rank's group. Nothing happens unless this process
    leads its group.
    """
    if os.getpgid(0) != os.getpid():
        return
    read, write = os.pipe()  # not inherited by what this process starts (PEP 446)
    try:
        _OWN_GROUP_KEEPER.append(_start_keeper(read))
        os.write(write, f"+{os.getpid()}\n".encode())
    except OSError:  # without it only what this process started may outlive it
        os.close(write)
        return
    finally:
        os.close(read)
    os.register_at_fork(after_in_child=lambda: os.close(write))  # nor by a forked worker
