"""One attempt: each rank's environment and ``WorkerGroup``, the ranks' output and exits watched
from the calling thread on one ``select.poll``."""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import re
import select
import signal
import socket
import time
from collections import namedtuple
from typing import Callable, Dict, List, Optional

from ddp_tutorial import envvars, runfolder
from ddp_tutorial.launcher import net, procgroup
from ddp_tutorial.launcher.errors import LaunchError
from ddp_tutorial.launcher.spec import PACKAGE_DIR, LaunchSpec

#: Seconds to read what the ranks wrote before they exited (a pipe that a grandchild which left
#: the rank's group holds open is not waited for longer).
DRAIN_S = 2.0
# torch prefixes each line of a rank's uncaught exception with "[rankN]:".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_WATCH: Dict[int, tuple] = {}  # pid -> (launcher's end, ranks' end) of the watch socket


def launcher_watch() -> socket.socket:
    """The ranks' end of a socket pair whose other end only this process holds: end-of-file there
    means this process is gone, however it ended, and the ranks then kill their groups."""
    if os.getpid() not in _WATCH:  # none yet, or we are a fork: our parent's is not ours
        _WATCH.clear()
        _WATCH[os.getpid()] = socket.socketpair()
    return _WATCH[os.getpid()][1]


def worker_env() -> Dict[str, str]:
    """What every process the kit starts to run a script begins with: ours less an outer launcher's
    variables (a check inside a rank must not look like it), the package on PYTHONPATH, unbuffered,
    gloo and nccl on loopback, one thread per rank by default (N ranks x all cores thrash)."""
    outer = set(envvars.TORCHRUN_CONTRACT) | {envvars.STORE, envvars.LAUNCHER_FD}
    env = {k: v for k, v in os.environ.items()
           if k not in outer and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent),
                                                      env.get("PYTHONPATH")]))
    lo = net.loopback_interface()
    if lo:  # whatever the host name resolves to
        env.update({"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo})
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def rank_env(spec: LaunchSpec, rank: int, port: int, attempt: int, store: str) -> Dict[str, str]:
    """``worker_env()``, torchrun's contract, the kit's variables, then ``spec.env``. ``store``:
    ``"fd:N"`` (rank 0 hosts on the socket ``launch`` bound), ``"bind"`` or ``"join"``."""
    env, world = worker_env(), str(spec.world_size)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world, "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": net.LOOPBACK, "MASTER_PORT": str(port),
        envvars.RESTART_COUNT: str(attempt), envvars.MAX_RESTARTS: str(spec.max_restarts),
        # env:// must not start a second store (on all interfaces): every rank joins rank 0's.
        envvars.USE_AGENT_STORE: "True",
        envvars.RUN_DIR: str(spec.run_dir), envvars.BACKEND: spec.backend, envvars.STORE: store,
    })
    env.update(spec.env)
    return env


#: One attempt (``number`` 0, one more per restart): its ranks, the store's port, how it started.
Attempt = namedtuple("Attempt", "number group port start_mode cold_reason")


def start_attempt(spec: LaunchSpec, number: int, cold_reason: Optional[str]) -> Attempt:
    """Start one attempt's ranks (warm if ``cold_reason`` is None)."""
    try:
        sock = None if spec.master_port else net.listen_socket()
    except OSError as exc:
        raise LaunchError(f"could not open a listening socket on {net.LOOPBACK}: {exc}") from exc
    try:
        port = spec.master_port or sock.getsockname()[1]
        store = "bind" if sock is None else f"fd:{sock.fileno()}"
        envs = [rank_env(spec, r, port, number, "join" if r else store)
                for r in range(spec.world_size)]
        group = WorkerGroup(spec.cmd, envs, spec.echo, sock, launcher_watch(), cold_reason is None)
    finally:
        if sock is not None:
            sock.close()  # rank 0 holds it now: the port is free again once rank 0 exits
    mode = "warm" if cold_reason is None else "cold"
    runfolder.note_start(spec.run_dir, number, mode, cold_reason, group.pids)
    return Attempt(number, group, port, mode, cold_reason)


class WorkerGroup:
    """The processes of one attempt (``procs``: ``Popen`` or ``warm.WarmRank``), one per ``envs``,
    each running ``cmd``. Per rank: ``output`` (its lines, torch's ``[rankN]:`` removed),
    ``exit_codes`` (once reaped; negative: killed by that signal), ``exit_seen`` (monotonic time);
    ``scripts_done``: ranks whose script ended well but which stay (rank 0 keeps the store)."""

    def __init__(self, cmd: List[str], envs: List[Dict[str, str]], echo: str,
                 store: Optional[socket.socket], watch: socket.socket, warm_start: bool = False):
        self.output: Dict[int, List[str]] = {r: [] for r in range(len(envs))}
        self.exit_codes: Dict[int, Optional[int]] = {r: None for r in range(len(envs))}
        self.exit_seen: Dict[int, float] = {}
        self.scripts_done: set = set()
        self.echo = echo
        self.procs: list = []
        self._poll = select.poll()
        self._pipes: Dict[int, tuple] = {}  # fd -> (rank, decoder, stream)
        self._partial: Dict[int, str] = {r: "" for r in range(len(envs))}
        # Rank 0 writes here when its script has ended, and keeps the store until this end closes.
        self._peers, rank0_peers = socket.socketpair() if len(envs) > 1 else (None, None)
        if self._peers is not None:
            self._poll.register(self._peers.fileno(), select.POLLIN)
        try:
            for rank, env in enumerate(envs):
                p = procgroup.start(rank, cmd, env, store, watch, warm_start,
                                    rank0_peers if rank == 0 else None)
                self.procs.append(p)
                utf8 = codecs.getincrementaldecoder("utf-8")("replace")
                lines = io.IncrementalNewlineDecoder(utf8, True)  # \r\n and \r as \n
                self._pipes[p.stdout.fileno()] = (rank, lines, p.stdout)
                self._poll.register(p.stdout.fileno(), select.POLLIN)
        except BaseException:
            self.stop(grace=0.0)
            self.close()
            raise
        finally:
            if rank0_peers is not None:
                rank0_peers.close()  # rank 0 holds it now

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for output; handle every line that came."""
        for fd, _ in self._poll.poll(max(0, int(timeout_s * 1000))):
            if self._peers is not None and fd == self._peers.fileno():
                if self._peers.recv(1):
                    self.scripts_done.add(0)  # rank 0's script succeeded: it only hosts the store
                self._poll.unregister(fd)
            elif fd in self._pipes:
                rank, decoder, _ = self._pipes[fd]
                data = os.read(fd, 65536)
                lines = (self._partial[rank] + decoder.decode(data, final=not data)).split("\n")
                self._partial[rank] = lines.pop()
                for line in lines:
                    self._line(rank, line)
                if not data:  # EOF: the rank and everything that shared its output closed it
                    self._close_pipe(fd)

    def _line(self, rank: int, line: str) -> None:
        line = _TORCH_RANK_PREFIX.sub("", line)  # we say "[rank r]" already
        self.output[rank].append(line)
        if self.echo == "all" or (self.echo == "rank0" and rank == 0):
            print(f"[rank {rank}] {line}", flush=True)

    def _close_pipe(self, fd: int) -> None:
        rank, _, stream = self._pipes.pop(fd)
        self._poll.unregister(fd)
        stream.close()
        if self._partial[rank]:  # a last line without a newline
            self._line(rank, self._partial[rank])
            self._partial[rank] = ""

    def reap(self) -> None:
        """Record the exit of every rank that ended, after killing what it left in its group."""
        for rank, p in enumerate(self.procs):
            if p.returncode is None and procgroup.has_exited(p):
                self.exit_seen.setdefault(rank, time.monotonic())
                procgroup.end(p)
                self.exit_codes[rank] = p.returncode
        if all(p.returncode is not None for p in self.procs[1:]):
            self._close_peers()

    def _close_peers(self) -> None:
        if self._peers is not None:
            with contextlib.suppress(KeyError):  # unregistered already when rank 0 wrote
                self._poll.unregister(self._peers.fileno())
            self._peers.close()  # rank 0 reads end-of-file: it may give up the store and exit
            self._peers = None

    def done(self) -> bool:
        """Whether every rank has been reaped."""
        return all(p.returncode is not None for p in self.procs)

    def wait(self, deadline: float, until: Callable[[], bool] = lambda: False,
             tick: float = 0.05) -> bool:
        """Handle output and exits until all are reaped (True), ``until()`` or ``deadline``."""
        while True:
            self.reap()
            left = deadline - time.monotonic()
            if self.done() or until() or left <= 0:
                return self.done()
            self.pump(min(tick, left))

    def ask_for_stacks(self, answered: Callable[[int], Optional[bool]], timeout_s: float) -> None:
        """Ask every live rank that can answer (``answered(rank)`` is not None) for its stacks, and
        wait until each ``answered``, exited, or ``timeout_s`` passed. All are asked while all run:
        a rank stopped first would close its connections, and its peers' stacks show no wait."""
        self.reap()
        asked = [r for r, p in enumerate(self.procs)
                 if p.returncode is None and answered(r) is not None]
        for rank in asked:
            procgroup.killpg(self.procs[rank], envvars.stacks_signal(), group=False)
        # a file being written wakes nothing: look again soon
        self.wait(time.monotonic() + timeout_s, tick=0.01, until=lambda: all(
            self.procs[r].returncode is not None or answered(r) for r in asked))

    def stop(self, grace: float = 1.0) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after ``grace`` s."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, procgroup.KILL_WAIT_S)):
            self.reap()
            for p in self.procs:
                procgroup.killpg(p, sig)
            if self.wait(time.monotonic() + wait_s):
                return

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Read what is left in the pipes (up to ``drain_s``), then close every descriptor."""
        end = time.monotonic() + drain_s
        while self._pipes and time.monotonic() < end:
            self.pump(min(0.05, end - time.monotonic()))
        for fd in list(self._pipes):
            self._close_pipe(fd)
        self._close_peers()

