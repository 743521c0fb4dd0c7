"""Warm launches: one helper process keeps torch imported, and ``launch`` has it fork the ranks.

Almost all of a cold 4-rank launch on a small machine is ``import torch`` in four new
processes. On its first launch a process starts one fork server (``forkserver/server.py``,
a child in a session of its own that dies with this process), which imports torch and
waits; each rank is then forked from it and turned into what ``python -u bootstrap.py
SCRIPT ARGS`` would be (see that file for what it sets). The launcher still watches each
rank's output pipe and process group; only the exit status comes from the server, which
keeps an exited rank unreaped until the launcher has swept its group (``WarmRank.wait``).

Anything the server cannot do safely or in time means a cold launch, never a failed one
(``acquire`` says why). This module imports no torch.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ddp_tutorial import envvars

SERVER_SCRIPT = str(Path(__file__).resolve().parent / "forkserver" / "server.py")
#: ``DDP_TUTORIAL_WARM=0`` turns warm launches off for every ``launch`` of this process.
#: Variables read while Python starts or torch is imported (the interpreter, the dynamic
#: linker, OpenMP and BLAS, torch, the locale): a forked rank keeps the server's values, so
#: a launch needing other values gets a server started with them.
STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "LANG", "HOME", "OMP_", "GOMP_", "KMP_", "MKL_",
                    "OPENBLAS_", "TORCH", "PYTORCH_", "MALLOC_", "GLIBC_")
#: Set by the launcher per launch and per attempt (``TORCHELASTIC_RESTART_COUNT``, ``_MAX_RESTARTS``,
#: ``_RUN_ID``, ...); torch reads them only when a rank calls into torch.distributed (the agent store,
#: ``is_torchelastic_launched``, the error file), never at import. Counted as startup settings, every
#: restart and every launch with another ``max_restarts`` replaced the server and paid its import.
PER_LAUNCH_PREFIXES = ("TORCHELASTIC_",)
#: The kit's own startup settings: a server without ``torch._dynamo`` serves only launches that ask for that.
STARTUP_NAMES = (envvars.FORK_SERVER_DYNAMO,)
#: Read at import too, but a forked rank reads them again (``forkserver/server.py``'s ``reapply_import_settings``),
#: so a launch with ``env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}`` needs no server of its own.
REAPPLIED_PER_RANK = ("TORCH_DISTRIBUTED_DEBUG",)
#: Of rank 0's environment, what the server's own must not have: its orphan checks and
#: ``ps e`` would take it for a rank of that run.
#: Bytes of room the server's command line and environment get, which a forked rank
#: rewrites to show its own (what ``ps`` and ``procinfo.cmdline``/``environ`` read).
ARGV_ROOM, ENV_ROOM = 16 << 10, 64 << 10
#: Seconds a server may take to import torch and say it is ready (at most half the launch's time).
START_S = 60.0
#: Seconds the server may take to answer one request before it is given up for a cold launch.
REPLY_S = 10.0
MAX_MESSAGE = 1 << 20


class ServerUnavailable(RuntimeError):
    """The fork server died, refused or did not answer in time: start cold instead."""


def warm_by_default() -> bool:
    """Whether ``launch`` tries warm starts unless told (``DDP_TUTORIAL_WARM=0`` says no)."""
    return os.environ.get(envvars.WARM, "1").strip().lower() not in ("0", "false", "no", "off")


def startup_env(env: Dict[str, str]) -> Dict[str, str]:
    """The part of ``env`` that takes effect at interpreter start or ``import torch`` (less what ranks reread),
    and the kit's own settings of what the server imports."""
    return {k: v for k, v in env.items() if (k.startswith(STARTUP_PREFIXES) and k not in REAPPLIED_PER_RANK
            and not k.startswith(PER_LAUNCH_PREFIXES)) or k in STARTUP_NAMES}


def _env_bytes(env: Dict[str, str]) -> int:
    return sum(len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in env.items())


class WarmRank:
    """A rank forked by the fork server, with what the launcher uses of ``Popen``.

    Attributes:
        pid: its pid, which is its process group id (it called ``setsid``).
        stdout: the read end of its output pipe.
        returncode: None until ``wait`` recorded its exit (-N: killed by signal N).
        lost: the server died before it reported this rank's exit; the rank dies
            with it (parent-death signal), and its group can no longer be swept safely.
    """

    def __init__(self, server: "ForkServer", pid: int, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self.lost = False
        self._server, self._code = server, None
        self._pidfd = os.pidfd_open(pid)  # names this process, even once its pid is free again

    def exited(self) -> bool:
        """Whether it has exited and is not reaped yet (its pid and group id are still its own)."""
        if self._code is None:
            self._server.pump()
        if self._code is None and self.lost and self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0]:  # dead (a pidfd reads as ready then)
                self._code = -signal.SIGKILL
        return self._code is not None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self.exited():
            self.wait()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Record the exit ``exited`` saw and let the server reap it (the launcher swept its group first)."""
        if self.returncode is not None:
            return self.returncode
        end = None if timeout is None else time.monotonic() + timeout
        while not self.exited():
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            self._server.wait_readable(0.05 if end is None else max(0.0, min(0.05, end - time.monotonic())))
        self.returncode = self._code
        if not self.lost:
            self._server.send({"reap": self.pid})
        os.close(self._pidfd)
        self._pidfd = None
        return self.returncode

    def _server_gone(self) -> None:
        if self._code is None:
            self.lost = True
            try:  # the parent-death signal is on its way; make sure of it
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except (OSError, AttributeError):
                pass


def ignored_signals() -> List[int]:
    """The signals this process ignores now: a cold rank inherits them through exec, a warm one is told."""
    found = []
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) is signal.SIG_IGN:
                found.append(int(sig))
        except ValueError:
            pass
    return found


class ForkServer:
    """One fork server process and this process's end of its control socket."""

    def __init__(self, env: Dict[str, str]):
        """Start the server; ``wait_ready`` says when it has torch imported.

        Args:
            env: rank 0's environment; the server starts with it (less its run folder).
        """
        self.startup = startup_env(env)
        self.started = time.monotonic()
        self.owner = os.getpid()  # a process forked from ours inherits this object, not the server
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = {k: v for k, v in env.items()
                      if k not in envvars.PER_RUN and not k.startswith(PER_LAUNCH_PREFIXES)}
        server_env[envvars.FORK_SERVER_ROOM] = "." * ENV_ROOM
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", SERVER_SCRIPT, str(theirs.fileno()), str(os.getpid()), "." * ARGV_ROOM],
                env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.sock.setblocking(False)
        self.info: Optional[Dict] = None  # the server's "ready" message
        self.why: Optional[str] = None  # why it cannot serve
        self.gone = False
        self.ranks: Dict[int, WarmRank] = {}
        #: pid -> exit code, for an exit reported before ``spawn`` made that pid a ``WarmRank``:
        #: a rank that fails at once (a taken port) exits before the launcher reads its "started".
        self._early_exits: Dict[int, int] = {}
        self._replies: Dict[int, Dict] = {}
        self._next_id = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fileno(self) -> int:
        return self.sock.fileno()

    def pump(self) -> None:
        """Handle every message that has come, without waiting."""
        while not self.gone:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._lose("the fork server exited")
                return
            message = json.loads(data)
            if "exited" in message:
                rank = self.ranks.pop(message["exited"], None)
                if rank is not None:
                    rank._code = message["code"]
                else:  # read in the same pump as its "started": spawn has not made it a WarmRank yet
                    self._early_exits[message["exited"]] = message["code"]
            elif "started" in message:
                self._replies[message["started"]] = message
            elif "ready" in message:
                self.info = message
                if not message["ready"]:
                    self.why = message["why"]
                    self._lose(message["why"])

    def wait_readable(self, timeout_s: float) -> None:
        if not self.gone:
            select.select([self.sock], [], [], timeout_s)

    def _await(self, done, deadline: float) -> bool:
        """Handle messages until ``done()`` or the server is gone or ``deadline``; ``done()``'s value."""
        while True:
            self.pump()
            if done() or self.gone or time.monotonic() >= deadline:
                return bool(done())
            self.wait_readable(min(0.5, deadline - time.monotonic()))

    def wait_ready(self, deadline: float) -> bool:
        """Wait until the server has imported torch (True) or cannot serve, or ``deadline``."""
        ready = self._await(lambda: self.info is not None, deadline)
        if not ready and self.why is None:
            self.why = "the fork server did not finish importing torch in time"
        return ready and self.info["ready"]

    def send(self, message: Dict, fds: Sequence[int] = ()) -> None:
        try:
            socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))
        except OSError as exc:  # e.g. EPIPE: it exited meanwhile; BlockingIOError: it stopped reading
            self._lose(f"the fork server cannot be reached: {exc}")
            raise ServerUnavailable(self.why) from None

    def fits(self, argv: Sequence[str], env: Dict[str, str]) -> Optional[str]:
        """None if a rank with ``argv`` and ``env`` can be forked here, else why not."""
        if startup_env(env) != self.startup:
            return "the launch's startup environment (PYTHON*, OMP_*, LD_*, ...) differs from the server's"
        if sum(len(os.fsencode(a)) + 1 for a in argv) > self.info["argv_room"]:
            return "the command line is longer than the fork server has room for"
        if _env_bytes(env) > self.info["env_room"]:
            return "the environment is larger than the fork server has room for"
        return None

    def spawn(self, argv: List[str], env: Dict[str, str], cwd: str, umask: int,
              store_fd: Optional[int]) -> WarmRank:
        """Fork one rank; it writes to a new pipe, whose read end is ``WarmRank.stdout``.

        Raises:
            ServerUnavailable: the server refused, died or did not answer within ``REPLY_S``.
        """
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self.send({"spawn": request_id, "argv": argv, "env": env, "cwd": cwd, "umask": umask,
                       "store": store_fd is not None, "ignored": ignored_signals()},
                      [write_end] if store_fd is None else [write_end, store_fd])
            os.close(write_end)
            write_end = -1
            if not self._await(lambda: request_id in self._replies, time.monotonic() + REPLY_S):
                self._lose(self.why if self.gone else "the fork server did not answer in time")
                raise ServerUnavailable(self.why)
            reply = self._replies.pop(request_id)
            if "error" in reply:
                self._lose(reply["error"])
                raise ServerUnavailable(self.why)
            rank = WarmRank(self, reply["pid"], open(read_end, "rb", buffering=0))
        except BaseException:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
            raise
        rank._code = self._early_exits.pop(rank.pid, None)
        if rank._code is None:  # its exit is still to come
            self.ranks[rank.pid] = rank
        return rank

    def _lose(self, why: str) -> None:
        """Give the server up: it cannot serve (it may still run; ``close`` stops it)."""
        if self.why is None:
            self.why = why
        if not self.gone:
            self.gone = True
            for rank in self.ranks.values():
                rank._server_gone()

    def close(self) -> None:
        """Stop the server (its ranks die with it) and reap it, within a bounded wait."""
        self._lose("closed")
        for rank in self.ranks.values():
            rank._server_gone()
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()  # not reaped yet: the pid is still the server's
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass


_SERVER: Optional[ForkServer] = None
#: One launch at a time uses the server; a second, concurrent one (another thread) starts cold.
_IN_USE = threading.Lock()
#: Startup environments a server could not serve with, and why: not tried again.
_REFUSED: Dict[Tuple, str] = {}


def server_pid() -> Optional[int]:
    """The pid of this process's fork server, if one runs."""
    return _SERVER.pid if _SERVER is not None and not _SERVER.gone else None


def acquire(argv: List[str], envs: List[Dict[str, str]], deadline: float) -> Tuple[Optional[ForkServer], str]:
    """The fork server for one launch, started if need be, or (None, why it starts cold).

    Call ``release`` when the launch's group is closed (also when this returns a server).

    Args:
        argv, envs: the ranks' command line and environments.
        deadline: the launch's; a server still importing torch is waited for until half
            the time left to it (at most ``START_S``).
    """
    global _SERVER
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return None, "warm launches need Linux >= 5.3 and Python >= 3.9"
    if not _IN_USE.acquire(blocking=False):
        return None, "another launch of this process is using the fork server"
    try:
        server = _SERVER
        if server is not None and server.owner != os.getpid():  # we are a fork of the server's owner
            server.sock.close()  # our copy only: the owner keeps its server
            _SERVER = server = None
        if server is not None:
            server.pump()
            if server.gone or startup_env(envs[0]) != server.startup:
                server.close()
                _SERVER = server = None
        key = tuple(sorted(startup_env(envs[0]).items()))
        if key in _REFUSED:
            raise ServerUnavailable(_REFUSED[key])
        if server is None:
            try:
                _SERVER = server = ForkServer(envs[0])
            except OSError as exc:
                raise ServerUnavailable(f"the fork server could not be started: {exc}") from None
        now = time.monotonic()
        if not server.wait_ready(min(server.started + START_S, now + (deadline - now) / 2)):
            if server.info is None and not server.gone and time.monotonic() < server.started + START_S:
                # Still importing, and this launch's deadline is too short to wait: it starts cold and
                # the server goes on importing for the next launch. Stopping it here would make every
                # short launch pay a new server's whole import, and none ever be served warm.
                server.why = None
                raise ServerUnavailable("the fork server is still importing torch; this launch's deadline "
                                        "is too short to wait for it")
            if server.info is not None:  # it answered, and refused: it would refuse again
                _REFUSED[key] = server.why
            why = server.why
            server.close()
            _SERVER = None
            raise ServerUnavailable(why)
        for env in envs:
            why = server.fits(argv, env)
            if why:
                raise ServerUnavailable(why)
        return server, ""
    except ServerUnavailable as exc:
        _IN_USE.release()
        return None, str(exc)
    except BaseException:  # e.g. the stop button while the server imports torch: it stays for later
        _IN_USE.release()
        raise


def prestart(env: Dict[str, str]) -> bool:
    """Start this process's fork server now and return at once; True if one was started.

    The first launch then finds torch (mostly) imported instead of importing it itself:
    in a notebook, the server imports while the learner reads. Nothing is started when
    warm launches are off, a server already runs, or one refused this startup environment.

    Args:
        env: rank 0's environment as ``launch`` would build it (only its startup part matters).
    """
    global _SERVER
    if not warm_by_default() or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return False
    if not _IN_USE.acquire(blocking=False):
        return False
    try:
        if _SERVER is not None or tuple(sorted(startup_env(env).items())) in _REFUSED:
            return False
        try:
            _SERVER = ForkServer(env)
        except OSError:
            return False  # the first launch tries again, or starts cold
        return True
    finally:
        _IN_USE.release()


def in_kernel() -> bool:
    """Whether this process is a Jupyter (IPython) kernel: where launches come cell after cell."""
    return "ipykernel" in sys.modules


def release(server: ForkServer) -> None:
    """End one launch's use of ``server``; a server that failed it is stopped."""
    global _SERVER
    if server.gone:
        if _SERVER is server:
            _SERVER = None
        server.close()
    _IN_USE.release()


@atexit.register
def _stop_server() -> None:
    """At exit (after the launcher stopped its groups): close the socket, the server exits and is reaped."""
    if _SERVER is not None:
        _SERVER.close()
