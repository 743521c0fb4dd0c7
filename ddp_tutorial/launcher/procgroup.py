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
import select
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
    """Start one rank as the leader of a new process group.

    Args:
        cmd: ``[python, -u, BOOTSTRAP, SCRIPT, ARGS...]``. store: the store's listening socket,
            for rank 0 only. watch: the ranks' end of the launcher's watch socket.
            peers: rank 0's end of the socket that reads end-of-file once the other ranks exited.
        warm_start: fork it from the forkserver (``warm.WarmRank``), else a new process.

    Returns:
        A ``subprocess.Popen`` or a ``warm.WarmRank``; its ``stdout`` is the output pipe.
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


def wait_for_exit(p: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until ``p`` exits, without reaping it (its group id stays ours)."""
    if p.returncode is not None:
        return True
    if not hasattr(os, "pidfd_open"):  # e.g. macOS: this reaps, so no group sweep follows
        try:
            p.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    _wait_for_fds(_pidfds([p.pid]), timeout)
    return has_exited(p)


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
    kill_groups_and_wait([pid for pid in strays if procinfo.alive(pid)])


def kill_groups_and_wait(pids: List[int], timeout: float = KILL_WAIT_S) -> None:
    """SIGKILL the process group each of ``pids`` leads, and wait (up to ``timeout``) until those processes are gone.

    For processes that are not our children (no reaping, no group id held): a pidfd is
    opened before the signal, so a pid reused meanwhile is not hit.
    """
    fds = _pidfds(pids)  # before the signals
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait_for_fds(fds, timeout)


def _pidfds(pids: List[int]) -> List[int]:
    """A pidfd for each of ``pids`` still there (none where the OS has no pidfds)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except (AttributeError, OSError):  # gone already, or no pidfd here
            pass
    return fds


def _wait_for_fds(fds: List[int], timeout: float) -> None:
    """Wait until each pidfd is readable (its process exited: no polling loop), or ``timeout``;
    close them all."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    pending, deadline = set(fds), time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            pending.discard(fd)
            poller.unregister(fd)
    for fd in fds:
        os.close(fd)


def wait_for_members(pgid: int, deadline: float) -> bool:
    """After a SIGKILL of group ``pgid``: wait until no member runs (True), or ``deadline`` (False).

    A SIGKILL takes effect when the process next runs, which on a busy machine
    can be a while; returning before then would leave it visible after the launch.
    Called while the leader is an unreaped zombie, so the group id is still ours.
    """
    while procinfo.group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # no event announces that a group emptied, so look again shortly
    return True


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


def killpg(p, sig: int) -> None:
    """Signal the process group of rank ``p``, only while ``p`` is not reaped (its pid is ours)."""
    if p.returncode is not None:
        return
    try:
        os.killpg(p.pid, sig)  # the group: the rank and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def signal_rank(p, sig: int) -> None:
    """Signal rank ``p`` itself (not its group), only while ``p`` is not reaped (its pid is ours)."""
    if p.returncode is not None:
        return
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(p) -> None:
    """Kill what an exited rank ``p`` left in its group (e.g. a DataLoader worker).

    Unreaped (Linux, cold), its pid is still its group's id. Reaped already (where Python has no
    ``os.waitid``, as on macOS, or a warm rank, which the forkserver reaps), the group is signalled
    only while psutil still finds members in it: a group id stays taken while it has members.
    """
    if p.returncode is None and not isinstance(p, warm.WarmRank):
        killpg(p, signal.SIGKILL)
    elif procinfo.group_members(p.pid):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    wait_for_members(p.pid, time.monotonic() + KILL_WAIT_S)
