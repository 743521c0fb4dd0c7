"""A rank's process group: start it, signal it, and end it. Each rank leads a group of its own
(cold: ``start_new_session``; warm: ``setsid``), so one signal reaches what it started too; if
this process dies without running code, each rank kills its own group (bootstrap.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

from ddp_tutorial import envvars
from ddp_tutorial.launcher import procinfo, warm
from ddp_tutorial.launcher.errors import LaunchError

#: Seconds a group gets to empty after SIGKILL (one stuck in uninterruptible I/O is left).
KILL_WAIT_S = 5.0


def start(rank: int, cmd: List[str], env: Dict[str, str], store: Optional[socket.socket],
          watch: socket.socket, warm_start: bool, peers: Optional[socket.socket] = None):
    """Start one rank leading a new process group: a ``subprocess.Popen`` or a ``warm.WarmRank``.
    ``store`` and ``peers``: rank 0's sockets; ``watch``: the ranks' end of the watch socket."""
    store = store if rank == 0 else None
    try:
        if warm_start:
            return warm.WarmRank(cmd[3:], env, store, watch, peers)
        fd_env = {envvars.LAUNCHER_FD: str(watch.fileno())}
        if peers is not None:
            fd_env[envvars.PEERS_FD] = str(peers.fileno())
        # A group of its own: a kill reaches what it started, and a terminal's Ctrl-C only us.
        return subprocess.Popen(cmd, env={**env, **fd_env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, bufsize=0,
                                pass_fds=[s.fileno() for s in (watch, store, peers) if s])
    except OSError as exc:
        raise LaunchError(f"could not start rank {rank}: {exc}") from exc


def wait_until(done, timeout: float) -> bool:
    """Look every 10 ms until ``done()`` (True) or ``timeout`` s (False): no event on every OS
    announces an exit without reaping it, or a group that emptied."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def has_exited(p) -> bool:
    """Whether rank ``p`` has exited, without reaping it where the OS allows."""
    if isinstance(p, warm.WarmRank):
        return p.exited()
    if not hasattr(os, "waitid"):  # e.g. macOS: this reaps
        return p.poll() is not None
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere already
        return p.poll() is not None


def killpg(p, sig: int, group: bool = True) -> None:
    """Signal the group of rank ``p`` (or ``p`` alone, not ``group``) while it is not reaped."""
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.killpg if group else os.kill)(p.pid, sig)


def end(p) -> None:
    """Once rank ``p`` has exited: kill what it left in its group (a DataLoader worker), wait up to
    ``KILL_WAIT_S`` until that is gone, reap it. The group's id is ours while ``p`` is not reaped;
    once it is (macOS, warm), only while members keep it taken: only then is it signalled."""
    if (p.returncode is None and not isinstance(p, warm.WarmRank)) or procinfo.group_members(p.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    wait_until(lambda: not procinfo.group_members(p.pid), KILL_WAIT_S)
    p.wait()  # it has exited: returns at once
