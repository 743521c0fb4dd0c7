"""A rank's process group: start it, signal it, sweep it.

Each rank leads a process group of its own (cold: ``start_new_session``; warm: the
forked child calls ``setsid``), so one signal reaches the rank and anything it
started. Its pid is the group's id, and stays ours only until the rank is reaped:
every signal here is sent before that (``killpg``, ``sweep``).

If this process dies without running any code (SIGKILL, a crashed kernel), each rank
reads end-of-file on the launcher's watch socket and kills its own group
(``rank/bootstrap.py``); a session ``start_session`` started is watched the same way
by ``guard.py``. The limit: a process that started a session of its own has left its
rank's group, and nothing here reaches it. What a process is, it asks ``procinfo`` (psutil).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ddp_tutorial import envvars
from ddp_tutorial.launcher import procinfo, warm
from ddp_tutorial.launcher.errors import LaunchError

#: Seconds the kernel gets to reap a rank after SIGKILL; a rank stuck in the
#: kernel (uninterruptible I/O) longer than this is left, not waited for forever.
KILL_WAIT_S = 5.0
#: Seconds a stopped session (``stop_session``) gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 3.0
#: Runs a session's command and kills its group once the launcher is gone (standard library only).
GUARD = str(Path(__file__).resolve().parent / "guard.py")


def start(rank: int, cmd: List[str], env: Dict[str, str], store: Optional[socket.socket],
          watch: socket.socket, warm_start: bool, peers: Optional[socket.socket] = None):
    """Start one rank as the leader of a new process group: a ``subprocess.Popen``, or a
    ``warm.WarmRank`` (``warm_start``); its ``stdout`` is the output pipe.

    Args:
        cmd: ``[python, -u, BOOTSTRAP, SCRIPT, ARGS...]``. store: the store's listening socket
            (rank 0). watch: the ranks' end of the launcher's watch socket. peers: rank 0's end
            of the socket that reads end-of-file once the other ranks exited.
    """
    store = store if rank == 0 else None
    try:
        if warm_start:
            return warm.WarmRank(cmd[3:], env, store, watch, peers)
        fds = tuple(s.fileno() for s in (watch, store, peers) if s is not None)
        fd_env = {envvars.LAUNCHER_FD: str(watch.fileno())}
        if peers is not None:
            fd_env[envvars.PEERS_FD] = str(peers.fileno())
        # start_new_session: the rank gets its own process group, so a kill
        # reaches anything it started, and a terminal's Ctrl-C reaches only us.
        return subprocess.Popen(cmd, env={**env, **fd_env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, bufsize=0, pass_fds=fds)
    except OSError as exc:
        raise LaunchError(f"could not start rank {rank}: {exc}") from exc


def start_session(cmd: List[str], env, cwd, output) -> subprocess.Popen:
    """Start ``cmd`` (a plain process, or torchrun) as the leader of a new session, under ``guard.py``.

    A session of its own, as a rank's: ``stop_session`` reaches everything it started
    that stayed in its group, and if this process dies, the guard kills that group.
    """
    from ddp_tutorial.launcher.start import launcher_watch

    watch = launcher_watch()
    return subprocess.Popen([sys.executable, "-I", "-S", GUARD, str(watch.fileno()), *cmd], env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True, pass_fds=(watch.fileno(),))


def _until(done, timeout: float) -> bool:
    """Look every 10 ms until ``done()`` (True) or ``timeout`` s (False): no event announces
    an exit without reaping it, or a group that emptied, on every OS."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)
    return True


def wait_for_exit(p: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until ``p`` exits, without reaping it (its group id stays ours)."""
    return _until(lambda: has_exited(p), timeout)


def end(p: subprocess.Popen) -> None:
    """Once ``p`` has exited: kill what it left in its group (``sweep``), then reap it."""
    sweep(p)
    p.wait()


def stop_session(p: subprocess.Popen, strays: Iterable[int] = (), grace: float = STOP_GRACE_S) -> None:
    """Stop a session ``start_session`` started, then the processes ``strays`` that left it.

    SIGTERM to its group lets the leader stop what it started (torchrun stops its
    ranks); after ``grace`` seconds what is left of the group gets SIGKILL. torchrun
    starts each rank in a session of its own, out of reach of its group: ``strays``
    (their pids, as they reported them) get SIGKILL to their own groups last.
    """
    killpg(p, signal.SIGTERM)
    wait_for_exit(p, grace)
    end(p)  # SIGKILL to the group, leader included if it still runs
    strays = [pid for pid in strays if procinfo.alive(pid)]
    for pid in strays:
        _killpg(pid, signal.SIGKILL)
    _until(lambda: not any(procinfo.alive(pid) for pid in strays), KILL_WAIT_S)


def has_exited(p) -> bool:
    """Whether rank ``p`` has exited, without reaping it (where the OS allows)."""
    if isinstance(p, warm.WarmRank):
        return p.exited()
    if not hasattr(os, "waitid"):  # e.g. macOS: this reaps, so no group sweep follows
        return p.poll() is not None
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere already
        return p.poll() is not None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def killpg(p, sig: int, group: bool = True) -> None:
    """Signal the process group of rank ``p`` (or ``p`` alone, not ``group``), only while ``p``
    is not reaped (its pid is ours)."""
    if p.returncode is not None:
        return
    if group:
        _killpg(p.pid, sig)
        return
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(p) -> None:
    """Kill what an exited rank ``p`` left in its group (e.g. a DataLoader worker), and wait
    (up to ``KILL_WAIT_S``) until it is gone: a SIGKILL takes effect when the process next runs.

    Unreaped (Linux, cold), its pid is still its group's id. Reaped already (where Python has no
    ``os.waitid``, as on macOS, or a warm rank, which the forkserver reaps), the group is signalled
    only while psutil still finds members in it: a group id stays taken while it has members.
    """
    if (p.returncode is None and not isinstance(p, warm.WarmRank)) or procinfo.group_members(p.pid):
        _killpg(p.pid, signal.SIGKILL)
    _until(lambda: not procinfo.group_members(p.pid), KILL_WAIT_S)
