"""Start one OS process per rank from a script file, and guard them from the notebook.

``launch`` is what a notebook cell calls. It gives the workers torchrun's
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT=<a free port>), streams their output as ``[rank r] ...``, and
returns a ``Run`` with each rank's metrics. It never pickles notebook code and
never forks the kernel: each rank is ``python <script>`` in a new process.

The fault contract: the first rank that fails stops the whole group
(``WorkerError`` with its traceback); a deadline turns a hang into
``LaunchTimeout``; an interrupt stops every worker; no worker outlives a launch.
This module imports no torch, so a launch costs the kernel nothing up front.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from ddp_tutorial import config
from ddp_tutorial.metrics import Run

PACKAGE_DIR = Path(__file__).resolve().parent
#: The training script, as a file path: ``launch(TRAIN_SCRIPT, 4, [...])``.
TRAIN_SCRIPT = str(PACKAGE_DIR / "train.py")
BOOTSTRAP = str(PACKAGE_DIR / "_bootstrap.py")
TRAIN_MODULE = "ddp_tutorial.train"


def scripts_path(name: str) -> str:
    """Path of a lesson script in ``ddp_tutorial/scripts``, e.g. ``scripts_path("hello.py")``."""
    return str(PACKAGE_DIR / "scripts" / name)


class LaunchError(RuntimeError):
    """Base class of every error ``launch`` raises.

    Attributes:
        run: the partial ``Run`` (metrics of the steps finished before the error), or None.
    """

    def __init__(self, message: str, run: Optional[Run] = None):
        super().__init__(message)
        self.run = run


class LaunchConfigError(LaunchError, ValueError):
    """Bad input, found before any process started."""


class WorkerError(LaunchError):
    """A rank raised or exited non-zero; every other rank was stopped.

    Attributes:
        rank: the first rank that failed.
        exit_code: its exit code (negative: killed by that signal).
        traceback: the end of its output, from its last traceback on.
    """

    def __init__(self, message, rank, exit_code, traceback, run=None):
        super().__init__(message, run)
        self.rank, self.exit_code, self.traceback = rank, exit_code, traceback


class LaunchTimeout(LaunchError, TimeoutError):
    """The deadline passed with ranks still running; all were stopped.

    Attributes:
        still_running: rank -> last micro-step it finished (None if none).
    """

    def __init__(self, message, still_running, run=None):
        super().__init__(message, run)
        self.still_running = still_running


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now, chosen at random below the OS's ephemeral range.

    Ports the OS hands out for outgoing connections (gloo opens many) come from
    the ephemeral range; a listening port picked from there could be taken by
    one of them before the store binds it. Below that range only listeners live.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()  # concurrent launches must not share a sequence
    for _ in range(100):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# torch prefixes each line of a rank's uncaught exception with "[rankN]:".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def port_taken(text: str) -> bool:
    """Whether a rank failed because its MASTER_PORT was taken (TCPStore: EADDRINUSE)."""
    text = text.lower()
    return "eaddrinuse" in text or "address already in use" in text


def _last_traceback(lines: List[str], max_lines: int = 40) -> str:
    """The rank's last Python traceback, or the tail of its output."""
    for i in range(len(lines) - 1, -1, -1):
        # torch prefixes a rank's uncaught exception with "[rankN]:"
        if re.match(r"(\[rank\d+\]:\s*)?Traceback \(most recent call last\)", lines[i]):
            return "\n".join(lines[i:i + max_lines])
    return "\n".join(lines[-15:]) or "(no output)"


# Groups still running, so an exiting kernel can stop them (atexit below).
_LIVE_GROUPS: "weakref.WeakSet[_WorkerGroup]" = weakref.WeakSet()


class _WorkerGroup:
    """The processes of one attempt, with a thread per pipe feeding one event queue."""

    def __init__(self, cmd: List[str], envs: List[Dict[str, str]], echo: str):
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.output: Dict[int, List[str]] = {r: [] for r in range(len(envs))}
        self.exit_codes: Dict[int, Optional[int]] = {r: None for r in range(len(envs))}
        self.echo = echo
        self.port: Optional[int] = None
        self.procs: List[subprocess.Popen] = []
        self.threads: List[threading.Thread] = []
        _LIVE_GROUPS.add(self)
        try:
            for rank, env in enumerate(envs):
                # start_new_session: the rank gets its own process group, so a kill
                # reaches anything it started, and a terminal's Ctrl-C reaches only us.
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     text=True, errors="replace", bufsize=1)
                self.procs.append(p)
                for target in (self._read, self._wait):
                    t = threading.Thread(target=target, args=(rank, p), daemon=True)
                    t.start()
                    self.threads.append(t)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def _read(self, rank: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            self.events.put(("line", rank, line.rstrip("\n")))
        self.events.put(("eof", rank, None))

    def _wait(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        self.events.put(("exit", rank, code))

    def handle(self, event: tuple) -> None:
        kind, rank, value = event
        if kind == "line":
            value = _TORCH_RANK_PREFIX.sub("", value)  # we say "[rank r]" already
            self.output[rank].append(value)
            if self.echo == "all" or (self.echo == "rank0" and rank == 0):
                print(f"[rank {rank}] {value}", flush=True)
        elif kind == "exit":
            self.exit_codes[rank] = value

    def kill(self, grace: float = 1.0) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left after ``grace`` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)  # the group: the rank and anything it started
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + grace
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            if p.poll() is None:
                p.wait()
        _LIVE_GROUPS.discard(self)


@atexit.register
def _stop_all_groups() -> None:
    for group in list(_LIVE_GROUPS):
        group.kill(grace=0.5)


def _resolve_script(script: Union[str, os.PathLike]) -> List[str]:
    """``[path]`` or ``["-m", module]`` for the worker command line; checks it exists."""
    text = os.fspath(script).strip()
    if text.startswith("-m "):
        module = text[3:].strip()
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LaunchConfigError(f"module {module!r} not found: cannot run `-m {module}`")
        return ["-m", module]
    path = Path(text).expanduser()
    if not path.is_file():
        raise LaunchConfigError(f"script not found: {str(path)!r} (give a .py file path, or '-m module')")
    return [str(path.resolve())]


def _is_train(target: List[str]) -> bool:
    return target == ["-m", TRAIN_MODULE] or target == [TRAIN_SCRIPT]


def _check_nccl(world_size: int) -> None:
    import torch  # only for an explicit nccl request: the kernel otherwise never pays for it

    if not torch.cuda.is_available():
        raise LaunchConfigError("backend 'nccl' needs CUDA GPUs, but torch.cuda.is_available() is "
                                "False here; use backend='gloo' (or 'auto') on CPU")
    gpus = torch.cuda.device_count()
    if gpus < world_size:
        raise LaunchConfigError(f"backend 'nccl' needs one GPU per rank: world_size={world_size} "
                                f"but only {gpus} GPU(s) are visible; use world_size <= {gpus}")


def _new_run_dir(run_dir, target: List[str]) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
        if path.exists() and any(path.iterdir()):
            raise LaunchConfigError(f"run_dir {str(path)!r} is not empty: each launch needs its own "
                                    "folder, so no earlier results are overwritten")
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()
    root = Path(os.environ.get("DDP_TUTORIAL_RUNS", "runs"))
    root.mkdir(parents=True, exist_ok=True)
    name = Path(target[-1]).stem if target[0] != "-m" else target[1].rsplit(".", 1)[-1]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.mkdtemp(prefix=f"{stamp}-{name}-", dir=root)).resolve()


def _worker_env(rank: int, world_size: int, port: int, run_dir: Path, backend: str,
                attempt: int, max_restarts: int, extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        # torchrun's contract, for one node
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        # ours
        "DDP_TUTORIAL_RUN_DIR": str(run_dir), "DDP_TUTORIAL_BACKEND": backend,
        "DDP_TUTORIAL_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), env.get("PYTHONPATH")])),
    })
    # One thread per rank unless asked otherwise: N ranks x all cores thrash a small machine.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def launch(script, world_size: int, args: Sequence[str] = (), *, timeout: float = 120.0,
           backend: str = "auto", run_dir=None, env: Optional[Dict[str, str]] = None,
           echo: str = "all", max_restarts: int = 0, master_port: Optional[int] = None,
           grace: float = 1.0) -> Run:
    """Run ``script`` as ``world_size`` processes, one per rank, and return their results.

    Args:
        script: a .py file path (e.g. ``TRAIN_SCRIPT``), or ``"-m package.module"``.
        world_size: number of ranks (processes) to start.
        args: command-line arguments for every rank.
        timeout: seconds for the whole launch; a run still going then is a hang.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``, passed as DDP_TUTORIAL_BACKEND.
        run_dir: an empty or new folder for the results; default ``runs/<time>-<script>-<id>``.
        env: extra environment variables for the workers (they win over ours).
        echo: ``"all"`` prints every rank's output live, ``"rank0"`` only rank 0's, ``"none"`` nothing.
        max_restarts: like torchrun's ``--max-restarts``: after a failure, stop the
            group and start it again (TORCHELASTIC_RESTART_COUNT counts the attempts).
        master_port: a fixed port instead of a free one (to show why not to hard-code it).
        grace: seconds between SIGTERM and SIGKILL when stopping workers.

    Returns:
        The ``Run``: per-rank metrics from ``run_dir``, output lines and wall time.

    Raises:
        LaunchConfigError: bad input; nothing was started.
        WorkerError: a rank failed (after any restarts); all ranks were stopped.
        LaunchTimeout: ``timeout`` passed; all ranks were stopped.
    """
    t0 = time.monotonic()
    if not isinstance(world_size, int) or world_size < 1:
        raise LaunchConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in ("auto", "gloo", "nccl"):
        raise LaunchConfigError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if timeout <= 0:
        raise LaunchConfigError(f"timeout must be positive, got {timeout!r}")
    if echo not in ("all", "rank0", "none"):
        raise LaunchConfigError(f"echo must be 'all', 'rank0' or 'none', got {echo!r}")
    args = [str(a) for a in args]
    target = _resolve_script(script)
    if _is_train(target):
        try:
            parsed = config.parse(args, world_size)
        except config.ConfigError as exc:
            raise LaunchConfigError(str(exc)) from None
        if "--backend" in args:
            backend = parsed.backend
        if "--out" in args:
            run_dir = run_dir if run_dir is not None else parsed.out
    if backend == "nccl":
        _check_nccl(world_size)
    run_dir = _new_run_dir(run_dir, target)
    cmd = [sys.executable, "-u", BOOTSTRAP, *target, *args]

    deadline = t0 + timeout
    attempt, port_retries = 0, 0
    while True:
        port = master_port or free_port()
        envs = [_worker_env(r, world_size, port, run_dir, backend, attempt, max_restarts, env)
                for r in range(world_size)]
        group = _WorkerGroup(cmd, envs, echo)
        group.port = port
        try:
            output, exit_codes = _supervise(group, deadline, timeout, run_dir, grace)
            break
        except WorkerError as exc:
            if master_port is None and port_retries < 2 and port_taken(exc.traceback):
                port_retries += 1  # another program took the port between our pick and its bind
                print(f"[launch] port {port} was taken meanwhile; retrying on a new port", flush=True)
                continue
            if attempt >= max_restarts:
                raise
            attempt += 1
            print(f"[launch] rank {exc.rank} failed ({_describe_exit(exc.exit_code)}); "
                  f"restarting all ranks, attempt {attempt} of {max_restarts}", flush=True)
    run = Run(run_dir, world_size)
    run.output, run.exit_codes = output, exit_codes
    run.pids, run.master_port = group.pids, port
    run.wall_seconds = time.monotonic() - t0
    return run


def _supervise(group: _WorkerGroup, deadline: float, timeout: float, run_dir: Path, grace: float):
    """Wait for the group, printing its output; stop it all on failure, deadline or interrupt."""
    failed: Optional[int] = None
    try:
        while True:
            try:
                group.handle(group.events.get(timeout=max(0.0, min(0.1, deadline - time.monotonic()))))
            except queue.Empty:
                pass
            codes = group.exit_codes
            failed = next((r for r, c in codes.items() if c not in (None, 0)), None)
            if failed is not None or all(c is not None for c in codes.values()):
                break
            if time.monotonic() >= deadline:
                break
    except BaseException:  # KeyboardInterrupt from the notebook's stop button, and the like
        group.kill(grace)
        raise
    if failed is None and all(c is not None for c in group.exit_codes.values()):
        _finish(group, grace)
        return group.output, dict(group.exit_codes)
    # Failure or deadline: read what is left, stop everyone, then explain.
    still = [r for r, c in group.exit_codes.items() if c is None]
    group.kill(grace)
    _finish(group, grace)
    run = Run(run_dir, len(group.procs))
    run.output, run.pids = group.output, group.pids
    run.master_port = group.port
    if failed is not None:
        code = group.exit_codes[failed]
        tb = _last_traceback(group.output[failed])
        others = ", ".join(str(r) for r in still) or "none"
        raise WorkerError(
            f"rank {failed} failed with {_describe_exit(code)}; stopped the other ranks still "
            f"running ({others}). Results so far: {run_dir}\n--- rank {failed} output ---\n{tb}",
            failed, code, tb, run)
    detail = ", ".join(
        f"rank {r} at step {run.last_step(r)}" if run.last_step(r) is not None
        else f"rank {r} before its first step" for r in still)
    raise LaunchTimeout(
        f"timed out after {timeout:g} s with ranks still running: {detail} (last finished "
        f"micro-step). A rank waiting for a peer that never comes looks like this: a wrong "
        f"world size, a skipped collective, or uneven inputs. All ranks were stopped. "
        f"Results so far: {run_dir}", {r: run.last_step(r) for r in still}, run)


def _finish(group: _WorkerGroup, grace: float) -> None:
    """Reap the group and read its remaining output (pipes close when the ranks exit)."""
    if any(p.poll() is None for p in group.procs):
        group.kill(grace)
    # Kill leftovers in the ranks' process groups (e.g. a DataLoader worker).
    for p in group.procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for t in group.threads:
        t.join(timeout=2.0)
    while True:
        try:
            group.handle(group.events.get_nowait())
        except queue.Empty:
            break
    _LIVE_GROUPS.discard(group)
