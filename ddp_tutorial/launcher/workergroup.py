"""``WorkerGroup``: the ranks of one attempt, their output and their exits, watched from one thread.

One ``select.poll`` covers every rank's output pipe and, per rank, what becomes readable
when it exits: a pidfd (Linux) for a cold rank, the forkserver's sentinel for a warm one;
elsewhere an exit is seen within a poll tick. What happens to each rank's process group is
``procgroup``'s.
"""

from __future__ import annotations

import atexit
import codecs
import io
import os
import re
import select
import signal
import socket
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from ddp_tutorial import envvars
from ddp_tutorial.launcher import procgroup, warm

#: Seconds to read what the ranks wrote before they exited (what a grandchild
#: that left their process group still holds open is not waited for longer).
DRAIN_S = 2.0
# torch prefixes each line of a rank's uncaught exception with "[rankN]:".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
# Groups still running, so an exiting kernel can stop them (atexit below).
_LIVE_GROUPS: "weakref.WeakSet[WorkerGroup]" = weakref.WeakSet()


class WorkerGroup:
    """The processes of one attempt, watched from the calling thread alone (no threads).

    Attributes:
        output: rank -> the lines it printed, torch's ``[rankN]:`` prefix removed.
        exit_codes: rank -> its exit code once reaped (negative: killed by that signal), else None.
        exit_seen: rank -> ``time.monotonic()`` when its exit was first seen (a rank killed by
            a signal leaves no note of when it failed: this is the best time there is).
        procs: the ranks, ``subprocess.Popen`` or ``warm.WarmRank``.
        scripts_done: ranks whose script has ended well while the process stays (rank 0 keeps the
            store until the others exit: ``rank/store.py``).
    """

    def __init__(self, cmd: List[str], envs: List[Dict[str, str]], echo: str,
                 store: Optional[socket.socket], watch: socket.socket, warm_start: bool = False):
        """Start one process per environment in ``envs``, each running ``cmd``.

        Args:
            echo: "all" prints every rank's lines as ``[rank r] ...``, "rank0" only rank 0's, "none" none.
            store: the store's listening socket, for rank 0. watch: the launcher's watch socket.
            warm_start: fork the ranks from the forkserver (``warm.WarmRank``), else new processes.

        Raises:
            LaunchError: a rank could not be started (those started were stopped).
        """
        self.output: Dict[int, List[str]] = {r: [] for r in range(len(envs))}
        self.exit_codes: Dict[int, Optional[int]] = {r: None for r in range(len(envs))}
        self.exit_seen: Dict[int, float] = {}
        self.echo = echo
        self.procs: list = []
        self._poll = select.poll()
        self._pipes: Dict[int, Tuple[int, io.IncrementalNewlineDecoder, object]] = {}
        self._exit_fds: Dict[int, int] = {}  # fd that becomes readable at a rank's exit -> rank
        self._partial: Dict[int, str] = {r: "" for r in range(len(envs))}
        # Rank 0 hosts the store until this end closes, once the other ranks have exited (``reap``);
        # it says here when its script has ended (``scripts_done``).
        self._peers, rank0_peers = socket.socketpair() if len(envs) > 1 else (None, None)
        self.scripts_done: set = set()
        if self._peers is not None:
            self._poll.register(self._peers.fileno(), select.POLLIN)
        _LIVE_GROUPS.add(self)
        try:
            for rank, env in enumerate(envs):
                p = procgroup.start(rank, cmd, env, store, watch, warm_start, rank0_peers if rank == 0 else None)
                self.procs.append(p)
                self._watch(rank, p)
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

    def _watch(self, rank: int, p) -> None:
        fd = p.stdout.fileno()
        decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"), True)
        self._pipes[fd] = (rank, decoder, p.stdout)
        self._poll.register(fd, select.POLLIN)
        if isinstance(p, warm.WarmRank):
            self._exit_fds[os.dup(p.sentinel)] = rank  # ours to close: the rank's closes when it is reaped
        else:
            try:
                self._exit_fds[os.pidfd_open(p.pid)] = rank  # wakes the poll the moment the rank exits
            except (AttributeError, OSError):  # not Linux >= 5.3: exits are seen within a poll tick
                return
        self._poll.register(next(reversed(self._exit_fds)), select.POLLIN)

    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for output or an exit; handle every line that came."""
        for fd, _ in self._poll.poll(max(0, int(timeout_s * 1000))):
            if self._peers is not None and fd == self._peers.fileno():
                if self._peers.recv(1):
                    self.scripts_done.add(0)  # rank 0's script succeeded; it only hosts the store now
                self._poll.unregister(fd)
            elif fd in self._exit_fds:
                self._unwatch_exit(fd)
            elif fd in self._pipes:
                rank, decoder, _ = self._pipes[fd]
                data = os.read(fd, 65536)
                self._feed(rank, decoder.decode(data, final=not data))
                if not data:  # EOF: the rank and everything that shared its output closed it
                    self._close_pipe(fd)

    def _feed(self, rank: int, text: str) -> None:
        lines = (self._partial[rank] + text).split("\n")
        self._partial[rank] = lines.pop()
        for line in lines:
            self._line(rank, line)

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

    def _unwatch_exit(self, fd: int) -> None:
        self._exit_fds.pop(fd)
        self._poll.unregister(fd)
        os.close(fd)

    def reap(self) -> None:
        """Record the exit of every rank that ended, after killing what it left in its process group.

        The sweep happens while the rank is a zombie (seen with ``WNOWAIT``): its pid,
        and so its group id, cannot belong to anyone else until it is reaped.
        """
        for rank, p in enumerate(self.procs):
            if p.returncode is not None or not procgroup.has_exited(p):
                continue
            self.exit_seen.setdefault(rank, time.monotonic())
            procgroup.sweep(p)
            p.wait()  # it has exited: returns at once
            self.exit_codes[rank] = p.returncode
        if self._peers is not None and all(p.returncode is not None for p in self.procs[1:]):
            self._close_peers()
        if all(p.returncode is not None for p in self.procs):
            _LIVE_GROUPS.discard(self)

    def _close_peers(self) -> None:
        if self._peers is not None:
            try:
                self._poll.unregister(self._peers.fileno())
            except KeyError:  # already, when rank 0 wrote
                pass
            self._peers.close()  # rank 0 reads end-of-file: it may give up the store and exit
            self._peers = None

    def done(self) -> bool:
        """Whether every rank has been reaped."""
        return all(p.returncode is not None for p in self.procs)

    def wait(self, deadline: float) -> bool:
        """Handle output and exits until every rank is reaped or ``deadline``; True if all were."""
        while True:
            self.reap()
            left = deadline - time.monotonic()
            if self.done() or left <= 0:
                return self.done()
            self.pump(min(0.05, left))

    def ask_for_stacks(self, can_answer: Callable[[int], bool], answered: Callable[[int], bool],
                       timeout_s: float) -> None:
        """Ask every live rank that ``can_answer`` for its Python stacks (``envvars.stacks_signal()``),
        then handle output and exits until each rank asked has ``answered``, exited, or ``timeout_s``.

        Every rank answers while all are still running: a rank stopped first would close its
        connections, and a peer's stack would then show it failing instead of where it waited.
        """
        self.reap()
        asked = [r for r, p in enumerate(self.procs) if p.returncode is None and can_answer(r)]
        for rank in asked:
            procgroup.signal_rank(self.procs[rank], envvars.stacks_signal())
        end = time.monotonic() + timeout_s
        while True:
            self.reap()
            asked = [r for r in asked if self.procs[r].returncode is None and not answered(r)]
            left = end - time.monotonic()
            if not asked or left <= 0:
                return
            self.pump(min(0.01, left))  # a file being written wakes nothing: look again soon

    def stop(self, grace: float = 1.0) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after ``grace`` s."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, procgroup.KILL_WAIT_S)):
            self.reap()
            live = [p for p in self.procs if p.returncode is None]
            if not live:
                return
            for p in live:
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
        for fd in list(self._exit_fds):
            self._unwatch_exit(fd)
        self._close_peers()


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.stop(grace=0.5)
        group.close(drain_s=0.0)
