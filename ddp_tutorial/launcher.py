"""Start one OS process per rank from a script file, and guard them from the notebook.

``launch`` is what a notebook cell calls. It gives the workers torchrun's
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT=<a port it holds>), streams their output as ``[rank r] ...``, and
returns a ``Run`` with each rank's metrics. It never pickles notebook code and
never forks the kernel: each rank is ``python <script>`` in a new process, or,
warm (the default), forked from a fork server that has imported torch and
nothing else, and then set up as that new process would be (``warmstart``).

The fault contract: the first rank that fails stops the whole group
(``WorkerError`` with its traceback); a deadline turns a hang into
``LaunchTimeout``; an interrupt stops every worker; no worker outlives a launch.
Every input is checked before anything starts (``LaunchConfigError``).

Nothing listens beyond loopback: ``launch`` binds the rendezvous store's socket
on 127.0.0.1 itself and hands it to rank 0, whose bootstrap hosts the store on
it (``TCPStore(master_listen_fd=...)``); every rank, rank 0 included, joins as
a client, as under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True).
gloo and nccl are pinned to the loopback interface.

This module imports no torch, so a launch costs the kernel nothing up front.
"""

from __future__ import annotations

import atexit
import codecs
import importlib.util
import io
import math
import numbers
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence as SequenceABC
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ddp_tutorial import runfolder, stacks, warmstart
from ddp_tutorial.backend import BACKENDS
from ddp_tutorial.runfolder import Run

PACKAGE_DIR = Path(__file__).resolve().parent
#: What every rank runs first (``python -u BOOTSTRAP SCRIPT ARGS``); it then runs the script.
BOOTSTRAP = str(PACKAGE_DIR / "rank" / "bootstrap.py")
LOOPBACK = "127.0.0.1"
#: More ranks than this on one machine is a typo, not a plan.
MAX_WORLD_SIZE = 1024
ECHOES = ("all", "rank0", "none")
#: Seconds the kernel gets to reap a rank after SIGKILL; a rank stuck in the
#: kernel (uninterruptible I/O) longer than this is left, not waited for forever.
KILL_WAIT_S = 5.0
#: Seconds to read what the ranks wrote before they exited (what a grandchild
#: that left their process group still holds open is not waited for longer).
DRAIN_S = 2.0


def scripts_path(name: str) -> str:
    """Path of one of the kit's worker scripts by file name, e.g. ``scripts_path("hello.py")``.

    They live in the ``workers/`` folders beside the lesson that starts them.
    """
    found = sorted(PACKAGE_DIR.glob(f"**/workers/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} worker scripts named {name!r} in {PACKAGE_DIR}")
    return str(found[0])


class LaunchError(RuntimeError):
    """Base class of every error ``launch`` raises.

    Attributes:
        run: the partial ``Run`` (metrics of the steps finished before the error), or None.
    """

    def __init__(self, message: str, run: Optional[Run] = None):
        super().__init__(message)
        self.run = run


class LaunchConfigError(LaunchError, ValueError):
    """Bad input, found before any process started and before any folder was made."""


class WorkerError(LaunchError):
    """A rank raised or exited non-zero; every other rank was stopped.

    "First" is by when each rank failed, not by when its exit was seen: a rank notes
    the moment its script's exception reaches it (``rank/bootstrap.py``), and a
    rank killed by a signal counts from when its exit was seen.

    Attributes:
        rank: the first rank that failed.
        exit_code: its exit code (negative: killed by that signal).
        traceback: the end of its output, from its last traceback on.
        failed_after: the other ranks that failed on their own, in the order they failed.
    """

    def __init__(self, message, rank, exit_code, traceback, run=None, failed_after=()):
        super().__init__(message, run)
        self.rank, self.exit_code, self.traceback = rank, exit_code, traceback
        self.failed_after = list(failed_after)


class LaunchTimeout(LaunchError, TimeoutError):
    """The deadline passed with ranks still running; all were stopped.

    Attributes:
        still_running: rank -> last micro-step it finished (None if none).
        stacks: rank -> its script's Python stack when it was stopped (most recent call
            first), for each rank still running; ``launch`` also prints them once.
        waiting_in: rank -> the torch.distributed call it was inside (e.g. ``"all_reduce"``),
            or None.
    """

    def __init__(self, message, still_running, run=None, stacks=None, waiting_in=None):
        super().__init__(message, run)
        self.still_running = still_running
        self.stacks = dict(stacks or {})
        self.waiting_in = dict(waiting_in or {})


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free right now, chosen at random outside the OS's ephemeral range.

    For a server you start yourself (e.g. a torchrun rendezvous endpoint).
    Ports the OS hands out for outgoing connections (gloo opens many) come from
    the ephemeral range; a listening port picked from there could be taken by
    one of them first. ``launch`` needs none of this: it binds its store's
    socket itself (``_listen_socket``) and hands it to rank 0.
    """
    for port in _candidate_ports():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _candidate_ports(tries: int = 100):
    """Up to ``tries`` random ports outside the ephemeral range (none if there is no room)."""
    rng = random.SystemRandom()  # concurrent launches must not share a sequence
    ranges = _listener_ranges(*_ephemeral_range())
    sizes = [high - low for low, high in ranges]
    for _ in range(tries if ranges else 0):
        low, high = rng.choices(ranges, weights=sizes)[0]
        yield rng.randrange(low, high)


def _listener_ranges(low: int, high: int, floor: int = 20000, min_size: int = 1000):
    """Port ranges ``[a, b)`` outside the ephemeral range ``[low, high]`` with room to pick from.

    Below the range from ``floor`` up (clear of well-known services) if that leaves
    ``min_size`` ports, else above it, else from 1024 up; empty if none is big enough.
    """
    for a, b in ((floor, low), (high + 1, 65536), (1024, low)):
        if b - a >= min_size:
            return [(a, b)]
    return []


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _listen_socket() -> socket.socket:
    """A TCP socket listening on 127.0.0.1 at a free port: the store's, for rank 0.

    Bound before any rank starts, so no other program can take the port in
    between, and ranks that connect before rank 0 hosts the store wait in the
    backlog instead of being refused and backing off. The port is outside the
    ephemeral range, and SO_REUSEADDR is set as TCPStore sets it, so once the
    run ends the port can be listened on again (no outgoing connection takes it,
    and the store's closed connections in TIME_WAIT do not block it).
    """
    for port in [*_candidate_ports(), 0]:  # 0: the OS picks, if the range leaves no room
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, port))
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError:
            sock.close()
            if port == 0:  # the last try: nothing was free
                raise


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback network interface (``lo`` on Linux), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return next((n for n in names if n in ("lo", "lo0")), None)


def describe_exit(code: int) -> str:
    """An exit status in words: "exit code 3", or "killed by SIGKILL" for a negative one."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# torch prefixes each line of a rank's uncaught exception with "[rankN]:".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def port_taken(text: str) -> bool:
    """Whether a rank failed because its MASTER_PORT was taken (EADDRINUSE)."""
    text = text.lower()
    return "eaddrinuse" in text or "address already in use" in text


def _last_traceback(lines: List[str], max_lines: int = 40) -> str:
    """The rank's last Python traceback, or the tail of its output."""
    for i in range(len(lines) - 1, -1, -1):
        # torch prefixes a rank's uncaught exception with "[rankN]:"
        if re.match(r"(\[rank\d+\]:\s*)?Traceback \(most recent call last\)", lines[i]):
            return "\n".join(lines[i:i + max_lines])
    return "\n".join(lines[-15:]) or "(no output)"


# -- Checking every input before anything starts --------------------------------
def _refuse(name: str, allowed: str, value) -> LaunchConfigError:
    return LaunchConfigError(f"{name} must be {allowed}, got {value!r}")


def _integer(name: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]``; bools, floats and strings are refused."""
    allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _refuse(name, allowed, value)
    if value < low or (high is not None and value > high):
        raise _refuse(name, allowed, value)
    return int(value)


def _seconds(name: str, value, positive: bool) -> float:
    """``value`` as a finite number of seconds, > 0 (``positive``) or >= 0."""
    allowed = "a finite number of seconds " + ("> 0" if positive else ">= 0")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _refuse(name, allowed, value)
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise _refuse(name, allowed, value)
    return value


def _choice(name: str, value, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise _refuse(name, allowed, value)
    return value


def _no_nul(name: str, text: str) -> str:
    if "\0" in text:
        raise LaunchConfigError(f"{name} must not contain a NUL character, got {text!r}")
    return text


def _path_text(name: str, value) -> str:
    """A path given as str or os.PathLike, non-empty and without NUL."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text.strip():
            return _no_nul(name, text)
    raise _refuse(name, "a non-empty path (str or os.PathLike)", value)


def _args_param(args) -> List[str]:
    """The argument list: strings, numbers or paths, each one argument."""
    allowed = "a list of arguments such as ['--epochs', '2'] (strings, numbers or paths)"
    if isinstance(args, (str, bytes)) or not isinstance(args, SequenceABC):
        # one string would be split into characters
        raise _refuse("args", allowed, args)
    out = []
    for i, arg in enumerate(args):
        if isinstance(arg, bool) or not isinstance(arg, (str, numbers.Real, os.PathLike)):
            raise _refuse(f"args[{i}]", "a string, a number or a path", arg)
        text = os.fspath(arg) if isinstance(arg, os.PathLike) else str(arg)
        if not isinstance(text, str):
            raise _refuse(f"args[{i}]", "a string, a number or a path", arg)
        out.append(_no_nul(f"args[{i}]", text))
    return out


def _env_param(env) -> Dict[str, str]:
    """Extra environment variables: names and values are strings, names without '='."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise _refuse("env", "None or a dict of str -> str", env)
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise _refuse("env key", "a non-empty string without '=' or NUL", key)
        if not isinstance(value, str):
            raise _refuse(f"env[{key!r}]", "a string (environment values are text)", value)
        _no_nul(f"env[{key!r}]", value)
    return dict(env)


def _resolve_script(script) -> List[str]:
    """``[path]`` or ``["-m", module]`` for the worker command line; checks it exists."""
    text = _path_text("script", script).strip()
    if text.startswith("-m "):
        module = text[3:].strip()
        if not all(part.isidentifier() for part in module.split(".")):
            raise LaunchConfigError(f"script '-m {module}' does not name a module: "
                                    "give '-m package.module'")
        try:
            found = importlib.util.find_spec(module) is not None
        except Exception:  # a parent package that fails to import: not runnable either
            found = False
        if not found:
            raise LaunchConfigError(f"module {module!r} not found: cannot run `-m {module}`")
        return ["-m", module]
    path = Path(text).expanduser()
    if path.is_dir():
        raise LaunchConfigError(f"script {str(path)!r} is a folder: give a .py file path, or '-m module'")
    if not path.is_file():
        raise LaunchConfigError(f"script not found: {str(path)!r} (give a .py file path, or '-m module')")
    return [str(path.resolve())]


#: Argument checks for scripts whose flags can be checked in the kernel, before
#: anything starts: ``tuple(command target) -> check(args, world_size, backend, run_dir)``.
_ARG_CHECKS: Dict[Tuple[str, ...], Callable] = {}


def check_args_with(targets: Sequence[Sequence[str]], check: Callable) -> None:
    """Register ``check`` for a script's arguments; ``launch`` calls it before it starts anything.

    Args:
        targets: the script as ``launch`` resolves it, each form (``[path]``, ``["-m", module]``).
        check: ``check(args, world_size, backend, run_dir) -> (backend, run_dir, run_dir_name)``;
            it raises ``ValueError`` for bad arguments, and may take the backend or
            the run folder from them (``run_dir_name`` names where the folder came from).
    """
    for target in targets:
        _ARG_CHECKS[tuple(target)] = check


def _check_nccl(world_size: int) -> None:
    """Refuse nccl unless every rank can have a GPU of its own (imports torch, only for nccl)."""
    from ddp_tutorial.backend import choose_backend, gpu_count

    try:
        choose_backend("nccl", gpu_count(), world_size)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None


def _worker_env(rank: int, world_size: int, port: int, run_dir: Path, backend: str,
                attempt: int, max_restarts: int, store: str,
                extra: Dict[str, str]) -> Dict[str, str]:
    """One rank's environment: torchrun's contract, loopback-only networking, then ``extra``.

    Args:
        store: for rank 0, how its bootstrap hosts the store: ``"fd:N"`` (the
            socket ``launch`` bound) or ``"bind"`` (bind MASTER_PORT itself);
            ``"join"`` for the other ranks.
    """
    env = dict(os.environ)
    env.pop("DDP_TUTORIAL_STORE", None)
    env.update({
        # torchrun's contract, for one node
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        # Rank 0's bootstrap hosts the store on a loopback socket, so env:// must not
        # start a second server (on all interfaces): every rank connects as a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # ours
        runfolder.RUN_DIR_ENV: str(run_dir), "DDP_TUTORIAL_BACKEND": backend,
        "DDP_TUTORIAL_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), env.get("PYTHONPATH")])),
    })
    lo = loopback_interface()
    if lo:  # gloo's and nccl's own listening sockets: loopback, whatever the host name resolves to
        env.update({"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo})
    env["DDP_TUTORIAL_STORE"] = store
    # One thread per rank unless asked otherwise: N ranks x all cores thrash a small machine.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


# Groups still running, so an exiting kernel can stop them (atexit below).
_LIVE_GROUPS: "weakref.WeakSet[_WorkerGroup]" = weakref.WeakSet()

#: Kills the ranks' process groups (and so what the ranks started) if this process dies.
KEEPER_SCRIPT = str(PACKAGE_DIR / "group_keeper.py")
_KEEPER: Optional[subprocess.Popen] = None
_KEEPER_OWNER: Optional[int] = None
_KEEPER_LOCK = threading.Lock()


def keeper_pid() -> Optional[int]:
    """The pid of this process's group keeper (``group_keeper.py``), if one runs."""
    if _KEEPER is not None and _KEEPER_OWNER == os.getpid() and _KEEPER.poll() is None:
        return _KEEPER.pid
    return None


def _tell_keeper(line: str) -> None:
    """Send ``+pgid`` or ``-pgid`` to the group keeper, starting it (again) if need be.

    Without a keeper (it cannot be started) launches work as before: the ranks still
    die with this process, only what they started may outlive it.
    """
    global _KEEPER, _KEEPER_OWNER
    with _KEEPER_LOCK:
        for _ in range(2):
            if keeper_pid() is None:  # none yet, it died, or we are a fork of its owner
                lines = [f"+{p.pid}\n" for g in list(_LIVE_GROUPS) for p in g.procs
                         if p.returncode is None and not getattr(p, "lost", False)]
                try:
                    _KEEPER = subprocess.Popen([sys.executable, "-I", "-S", KEEPER_SCRIPT],
                                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True)
                except OSError:
                    _KEEPER = None
                    return
                _KEEPER_OWNER = os.getpid()
                line = "".join(lines) + line if line not in lines else "".join(lines)
            try:
                _KEEPER.stdin.write(line.encode())
                _KEEPER.stdin.flush()
                return
            except (OSError, ValueError):  # it died: start another, which gets every live group
                _KEEPER = None


@atexit.register
def _release_keeper() -> None:
    """At exit, after the groups were stopped: the keeper reads EOF, finds nothing left, exits."""
    if keeper_pid() is not None:
        try:
            _KEEPER.stdin.close()
            _KEEPER.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class _WorkerGroup:
    """The processes of one attempt, watched from the calling thread alone (no threads).

    One ``select.poll`` covers every rank's output pipe and, where the OS has
    them, a pidfd per rank that becomes readable when the rank exits.
    """

    def __init__(self, cmd: List[str], envs: List[Dict[str, str]], echo: str,
                 store_fd: Optional[int] = None, server: Optional[warmstart.ForkServer] = None):
        """Start one process per environment in ``envs``, each running ``cmd``.

        Args:
            store_fd: the store's listening socket, for rank 0.
            server: a fork server acquired for this group (``warmstart.acquire``): the
                ranks are forked from it; None starts them as new processes. The group
                releases it in ``close``.

        Raises:
            warmstart.ServerUnavailable: the server failed while starting the ranks
                (those started were stopped): start the group cold instead.
        """
        self.output: Dict[int, List[str]] = {r: [] for r in range(len(envs))}
        self.exit_codes: Dict[int, Optional[int]] = {r: None for r in range(len(envs))}
        #: rank -> time.monotonic() when its exit was first seen (a rank killed by a signal
        #: leaves no note of when it failed: this is the best time there is)
        self.exit_seen: Dict[int, float] = {}
        self.echo = echo
        self.port: Optional[int] = None
        self.procs: List[subprocess.Popen] = []  # or warmstart.WarmRank, forked by the server
        self._server = server
        self._poll = select.poll()
        self._server_fd: Optional[int] = None
        if server is not None:  # the server reports each rank's exit on its socket
            self._server_fd = server.fileno()
            self._poll.register(self._server_fd, select.POLLIN)
        self._pipes: Dict[int, Tuple[int, io.IncrementalNewlineDecoder, object]] = {}
        self._pidfds: Dict[int, int] = {}
        self._partial: Dict[int, str] = {r: "" for r in range(len(envs))}
        _LIVE_GROUPS.add(self)
        try:
            if server is not None:
                cwd, umask = os.getcwd(), _current_umask()
            for rank, env in enumerate(envs):
                if server is not None:
                    p = server.spawn(cmd, env, cwd, umask, store_fd if rank == 0 else None)
                    self.procs.append(p)
                    _tell_keeper(f"+{p.pid}\n")
                    self._watch(rank, p)
                    continue
                # start_new_session: the rank gets its own process group, so a kill
                # reaches anything it started, and a terminal's Ctrl-C reaches only us.
                try:
                    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, bufsize=0,
                                         pass_fds=(store_fd,) if rank == 0 and store_fd is not None else ())
                except OSError as exc:
                    raise LaunchError(f"could not start rank {rank}: {exc}") from exc
                self.procs.append(p)
                _tell_keeper(f"+{p.pid}\n")
                self._watch(rank, p)
        except BaseException:
            self.stop(grace=0.0)
            self.close()
            raise

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        fd = p.stdout.fileno()
        decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"), True)
        self._pipes[fd] = (rank, decoder, p.stdout)
        self._poll.register(fd, select.POLLIN)
        try:
            pidfd = os.pidfd_open(p.pid)  # wakes the poll the moment the rank exits
        except (AttributeError, OSError):  # not Linux >= 5.3: exits are seen within a poll tick
            return
        self._pidfds[pidfd] = rank
        self._poll.register(pidfd, select.POLLIN)

    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for output or an exit; handle every line that came."""
        for fd, _ in self._poll.poll(max(0, int(timeout_s * 1000))):
            if fd == self._server_fd:
                self._server.pump()
                if self._server.gone:  # its socket would read as ready from now on
                    self._unwatch_server()
            elif fd in self._pidfds:
                self._unwatch_pidfd(fd)
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

    def _unwatch_pidfd(self, fd: int) -> None:
        self._pidfds.pop(fd)
        self._poll.unregister(fd)
        os.close(fd)

    def reap(self) -> None:
        """Record the exit of every rank that ended, after killing what it left in its process group.

        The sweep happens while the rank is a zombie (seen with ``WNOWAIT``): its pid,
        and so its group id, cannot belong to anyone else until it is reaped.
        """
        for rank, p in enumerate(self.procs):
            if p.returncode is not None or not _has_exited(p):
                continue
            self.exit_seen.setdefault(rank, time.monotonic())
            if not getattr(p, "lost", False):  # a lost warm rank's pid may be another's by now
                _killpg(p, signal.SIGKILL)  # leftovers, e.g. a DataLoader worker
                _wait_for_members(p.pid, time.monotonic() + KILL_WAIT_S)
                _tell_keeper(f"-{p.pid}\n")  # before the reap: until then the group id is ours
            p.wait()  # it has exited: returns at once
            self.exit_codes[rank] = p.returncode
        if all(p.returncode is not None for p in self.procs):
            _LIVE_GROUPS.discard(self)

    def wait(self, deadline: float) -> bool:
        """Handle output and exits until every rank is reaped or ``deadline``; True if all were."""
        while True:
            self.reap()
            left = deadline - time.monotonic()
            if all(p.returncode is not None for p in self.procs) or left <= 0:
                return all(p.returncode is not None for p in self.procs)
            self.pump(min(0.05, left))

    def stop(self, grace: float = 1.0) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after ``grace`` s."""
        for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT_S)):
            self.reap()
            live = [p for p in self.procs if p.returncode is None]
            if not live:
                return
            for p in live:
                _killpg(p, sig)
            if self.wait(time.monotonic() + wait_s):
                return

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Read what is left in the pipes (up to ``drain_s``), then close every descriptor."""
        end = time.monotonic() + drain_s
        while self._pipes and time.monotonic() < end:
            self.pump(min(0.05, end - time.monotonic()))
        for fd in list(self._pipes):
            self._close_pipe(fd)
        for fd in list(self._pidfds):
            self._unwatch_pidfd(fd)
        if self._server is not None:
            self._unwatch_server()
            warmstart.release(self._server)
            self._server = None

    def _unwatch_server(self) -> None:
        if self._server_fd is not None:
            self._poll.unregister(self._server_fd)
            self._server_fd = None


def _current_umask() -> int:
    umask = os.umask(0o022)  # reading it means setting it: put it straight back
    os.umask(umask)
    return umask


def _has_exited(p: subprocess.Popen) -> bool:
    """Whether ``p`` has exited, without reaping it (where the OS allows)."""
    if isinstance(p, warmstart.WarmRank):  # the server keeps it unreaped until we say so
        return p.exited()
    if not hasattr(os, "waitid"):  # e.g. macOS: this reaps, so no group sweep follows
        return p.poll() is not None
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere already
        return p.poll() is not None


def _live_members(pgid: int) -> List[int]:
    """Processes of group ``pgid`` still running (not zombies), its leader aside; Linux's /proc, else []."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == pgid:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, _, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if int(pgrp) == pgid and state != b"Z":
            members.append(int(entry))
    return members


def _wait_for_members(pgid: int, deadline: float) -> bool:
    """After a SIGKILL of group ``pgid``: wait until no member runs (True), or ``deadline`` (False).

    A SIGKILL takes effect when the process next runs, which on a busy machine
    can be a while; returning before then would leave it visible after the launch.
    Called while the leader is an unreaped zombie, so the group id is still ours.
    """
    while _live_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # no event announces that a group emptied, so look again shortly
    return True


def _killpg(p: subprocess.Popen, sig: int) -> None:
    """Signal the process group of rank ``p``, only while ``p`` is not reaped (its pid is ours)."""
    if p.returncode is not None or getattr(p, "lost", False):
        return
    try:
        os.killpg(p.pid, sig)  # the group: the rank and anything it started
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.stop(grace=0.5)
        group.close(drain_s=0.0)


def prestart_fork_server() -> bool:
    """Start the fork server for this process's launches now, without waiting for it.

    ``import ddp_tutorial`` calls it in a Jupyter kernel, so that even the first launch
    cell is warm. True if a server was started (see ``warmstart.prestart``).
    """
    env = _worker_env(0, 1, 0, Path.cwd(), "gloo", 0, 0, "bind", {})  # as a default launch's rank 0
    return warmstart.prestart(env)


def launch(script, world_size: int, args: Sequence[str] = (), *, timeout: float = 120.0,
           backend: str = "auto", run_dir=None, env: Optional[Dict[str, str]] = None,
           echo: str = "all", max_restarts: int = 0, master_port: Optional[int] = None,
           grace: float = 1.0, warm: Optional[bool] = None) -> Run:
    """Run ``script`` as ``world_size`` processes, one per rank, and return their results.

    Args:
        script: a .py file path (e.g. ``TRAIN_SCRIPT``), or ``"-m package.module"``.
        world_size: number of ranks (processes) to start, 1 to ``MAX_WORLD_SIZE``.
        args: command-line arguments for every rank: a list (strings, numbers, paths).
        timeout: seconds for the whole launch (finite, > 0); a run still going then is a hang.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``, passed as DDP_TUTORIAL_BACKEND.
        run_dir: a new or empty folder for the results; default ``runs/<time>-<script>-<id>``.
        env: extra environment variables for the workers, str -> str (they win over ours).
        echo: ``"all"`` prints every rank's output live, ``"rank0"`` only rank 0's, ``"none"`` nothing.
        max_restarts: like torchrun's ``--max-restarts`` (>= 0): after a failure, stop the
            group and start it again (TORCHELASTIC_RESTART_COUNT counts the attempts).
        master_port: a fixed port, 1-65535, instead of one ``launch`` binds itself
            (to show why not to hard-code it); rank 0 binds it on 127.0.0.1.
        grace: seconds (finite, >= 0) between SIGTERM and SIGKILL when stopping workers.
        warm: fork the ranks from this process's fork server, which keeps torch imported
            (``warmstart``); False starts each rank as a new process; None (default):
            warm unless ``DDP_TUTORIAL_WARM=0``. nccl, and anything the server cannot
            serve safely, starts cold all the same; ``run.start_mode`` says which it was.

    Returns:
        The ``Run``: per-rank metrics from ``run_dir``, output lines, wall time, and
        ``start_mode`` ("warm" or "cold"; ``cold_reason`` says why, if cold).

    Raises:
        LaunchConfigError: bad input; nothing was started and no folder made.
        WorkerError: a rank failed (after any restarts); all ranks were stopped.
        LaunchTimeout: ``timeout`` passed; all ranks were stopped.
        LaunchError: a worker process could not be started at all.
    """
    t0 = time.monotonic()
    world_size = _integer("world_size", world_size, 1, MAX_WORLD_SIZE)
    timeout = _seconds("timeout", timeout, positive=True)
    grace = _seconds("grace", grace, positive=False)
    backend = _choice("backend", backend, BACKENDS)
    echo = _choice("echo", echo, ECHOES)
    max_restarts = _integer("max_restarts", max_restarts, 0)
    if warm is not None and not isinstance(warm, bool):
        raise _refuse("warm", "True, False or None", warm)
    if master_port is not None:
        master_port = _integer("master_port", master_port, 1, 65535)
    args = _args_param(args)
    extra_env = _env_param(env)
    target = _resolve_script(script)
    run_dir_name = "run_dir"
    check = _ARG_CHECKS.get(tuple(target))
    if check is not None:
        try:
            backend, run_dir, run_dir_name = check(args, world_size, backend, run_dir)
        except ValueError as exc:
            raise LaunchConfigError(str(exc)) from None
    if backend == "nccl":
        _check_nccl(world_size)
    stem = Path(target[-1]).stem if target[0] != "-m" else target[1].rsplit(".", 1)[-1]
    if run_dir is not None:
        run_dir = _path_text(run_dir_name, run_dir)  # as given: train.py does not expand ~ either
    try:
        run_dir = runfolder.claim(run_dir, stem, run_dir_name,
                                  {"script": target, "world_size": world_size, "args": args})
    except runfolder.RunFolderError as exc:
        raise LaunchConfigError(str(exc)) from None
    cmd = [sys.executable, "-u", BOOTSTRAP, *target, *args]

    deadline = t0 + timeout
    if not (warmstart.warm_by_default() if warm is None else warm):
        cold_reason = "warm launches are turned off (warm=False or DDP_TUTORIAL_WARM=0)"
    elif backend == "nccl":  # CUDA in a forked process is not what a cold rank gets: start cold
        cold_reason = "nccl launches start cold"
    else:
        cold_reason = warmstart.environment_before_torch(target)
    attempt = 0
    while True:
        group, port = _start_group(cmd, world_size, run_dir, backend, attempt, max_restarts,
                                   master_port, extra_env, echo, cold_reason, deadline)
        runfolder.note_start(run_dir, attempt, group.start_mode, group.cold_reason)
        try:
            output, exit_codes = _supervise(group, deadline, timeout, run_dir, grace, attempt)
            break
        except WorkerError as exc:
            if attempt >= max_restarts:
                raise
            attempt += 1
            print(f"[launch] rank {exc.rank} failed ({describe_exit(exc.exit_code)}); "
                  f"restarting all ranks, attempt {attempt} of {max_restarts}", flush=True)
    run = Run(run_dir, world_size)
    run.output, run.exit_codes = output, exit_codes
    run.pids, run.master_port = group.pids, port
    run.start_mode, run.cold_reason = group.start_mode, group.cold_reason
    run.wall_seconds = time.monotonic() - t0
    return run


def _start_group(cmd, world_size, run_dir, backend, attempt, max_restarts, master_port,
                 extra_env, echo, cold_reason: Optional[str], deadline: float) -> Tuple[_WorkerGroup, int]:
    """Start one attempt's ranks; rank 0 gets the store's listening socket (or binds master_port).

    Args:
        cold_reason: None to fork the ranks from the fork server if it can, else why not.
        deadline: the launch's (a fork server still starting is waited for within it).
    """
    while True:
        try:
            sock = None if master_port else _listen_socket()
        except OSError as exc:
            raise LaunchError(f"could not open a listening socket on {LOOPBACK}: {exc}") from exc
        try:
            port = master_port or sock.getsockname()[1]
            store = "bind" if sock is None else f"fd:{sock.fileno()}"
            envs = [_worker_env(r, world_size, port, run_dir, backend, attempt, max_restarts,
                                store if r == 0 else "join", extra_env) for r in range(world_size)]
            server = None
            if cold_reason is None:
                server, cold_reason = warmstart.acquire(cmd, envs, deadline)
            try:
                group = _WorkerGroup(cmd, envs, echo, None if sock is None else sock.fileno(), server)
            except warmstart.ServerUnavailable as exc:  # the group released the server
                # Never a failed launch because of the server: start cold, with a new socket
                # (the one given to the stopped rank 0 may hold its dead connections).
                cold_reason = f"the fork server failed: {exc}"
                continue
        finally:
            if sock is not None:
                sock.close()  # rank 0 holds it now: the port is free again once rank 0 exits
        group.port = port
        group.start_mode, group.cold_reason = ("warm", None) if server is not None else ("cold", cold_reason)
        return group, port


def _supervise(group: _WorkerGroup, deadline: float, timeout: float, run_dir: Path, grace: float,
               attempt: int = 0):
    """Wait for the group, printing its output; stop it all on failure, deadline or interrupt."""
    failed: Optional[int] = None
    try:
        while True:
            group.reap()
            codes = group.exit_codes
            failed = next((r for r, c in codes.items() if c not in (None, 0)), None)
            if failed is not None or all(c is not None for c in codes.values()):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            group.pump(min(0.05, left))
    except BaseException:  # KeyboardInterrupt from the notebook's stop button, and the like
        group.stop(grace)
        group.close(drain_s=0.0)
        raise
    if failed is None and all(c is not None for c in group.exit_codes.values()):
        group.close()
        runfolder.drop_rank_notes_if_empty(run_dir)
        return group.output, dict(group.exit_codes)
    # Failure or deadline: stop everyone, read what is left, then explain.
    failed_on_their_own = {r for r, c in group.exit_codes.items() if c not in (None, 0)}
    still = [r for r, c in group.exit_codes.items() if c is None]
    group.stop(grace)  # SIGTERM: each rank writes its stacks, or finishes reporting its failure
    group.close()
    run = Run(run_dir, len(group.procs))
    run.output, run.pids = group.output, group.pids
    run.master_port = group.port
    if failed is not None:
        order = _failure_order(group, failed_on_their_own, runfolder.failure_notes(run_dir, attempt))
        first, after = order[0], order[1:]
        code = group.exit_codes[first]
        tb = _last_traceback(group.output[first])
        stopped = ", ".join(str(r) for r in still if r not in after) or "none"
        later = "".join(f"; rank {r} failed after it ({describe_exit(group.exit_codes[r])})" for r in after)
        raise WorkerError(
            f"rank {first} failed first, with {describe_exit(code)}{later}; stopped the other ranks "
            f"still running ({stopped}). Results so far: {run_dir}\n--- rank {first} output ---\n{tb}",
            first, code, tb, run, after)
    detail = ", ".join(
        f"rank {r} at step {run.last_step(r)}" if run.last_step(r) is not None
        else f"rank {r} before its first step" for r in still)
    rank_stacks = stacks.rank_stacks(run_dir, attempt, still)
    waits = stacks.rank_waits(run_dir, attempt, still)
    if group.echo != "none":
        print(f"[launch] deadline passed; where each rank was:\n{stacks.format_stacks(rank_stacks, waits)}",
              flush=True)
    raise LaunchTimeout(
        f"timed out after {timeout:g} s with ranks still running: {detail} (last finished "
        f"micro-step). A rank waiting for a peer that never comes looks like this: a wrong "
        f"world size, a skipped collective, or uneven inputs. All ranks were stopped; "
        f"each one's Python stack is in .stacks. Results so far: {run_dir}",
        {r: run.last_step(r) for r in still}, run, rank_stacks, waits)


def _failure_order(group: _WorkerGroup, exited_failing, notes: Dict[int, dict]) -> List[int]:
    """The ranks that failed, earliest first: by the moment each noted its failure
    (``time.monotonic()``, one clock for the machine), else by when its exit was seen."""
    failed = set(exited_failing) | set(notes)

    def when(rank: int) -> Tuple[float, int]:
        noted = notes.get(rank, {}).get("failed_at")
        if isinstance(noted, (int, float)):
            return float(noted), rank
        return group.exit_seen.get(rank, math.inf), rank

    return sorted(failed, key=when)
