"""How one attempt starts: warm or cold, each rank's environment, and the store's socket for rank 0.

``cold_reason`` decides once per launch whether the ranks may be forked from the fork
server (``warmstart``) or must start as new processes, and says why;
``start_attempt`` then starts the ranks of one attempt and returns an ``Attempt``,
which holds every fact of how it started.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

from ddp_tutorial import envvars, runfolder
from ddp_tutorial.launcher import net, warmstart
from ddp_tutorial.launcher.errors import LaunchError
from ddp_tutorial.launcher.spec import PACKAGE_DIR, LaunchSpec
from ddp_tutorial.launcher.workergroup import WorkerGroup


@dataclass(frozen=True)
class Attempt:
    """One attempt's ranks and how they started.

    Attributes:
        number: 0 for the first attempt, then one more per restart (TORCHELASTIC_RESTART_COUNT).
        group: its ranks. ``port``: the store's (MASTER_PORT).
        start_mode: "warm" or "cold"; ``cold_reason``: why cold (None when warm).
    """

    number: int
    group: WorkerGroup
    port: int
    start_mode: str
    cold_reason: Optional[str]


def cold_reason(spec: LaunchSpec) -> Optional[str]:
    """Why the ranks must start as new processes (cold), or None: they may be forked from the fork server."""
    if not (warmstart.warm_by_default() if spec.warm is None else spec.warm):
        return "warm launches are turned off (warm=False or DDP_TUTORIAL_WARM=0)"
    if spec.backend == "nccl":  # CUDA in a forked process is not what a cold rank gets: start cold
        return "nccl launches start cold"
    return environment_before_torch(spec.target)


def worker_env() -> Dict[str, str]:
    """The environment every process the kit starts to run a script begins with.

    This process's environment without an outer launcher's variables (torchrun's
    contract, ``TORCHELASTIC_*``, the kit's own per-launch ones: a check run inside a
    rank must not look like that rank), the package on PYTHONPATH, unbuffered output,
    gloo's and nccl's sockets on loopback, and one thread unless asked otherwise.
    """
    outer = set(envvars.TORCHRUN_CONTRACT) | {envvars.STORE, envvars.LAUNCHER_PID}
    env = {k: v for k, v in os.environ.items() if k not in outer and not k.startswith("TORCHELASTIC_")}
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), env.get("PYTHONPATH")])),
    })
    lo = net.loopback_interface()
    if lo:  # gloo's and nccl's own listening sockets: loopback, whatever the host name resolves to
        env.update({"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo})
    # One thread per rank unless asked otherwise: N ranks x all cores thrash a small machine.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def rank_env(spec: LaunchSpec, rank: int, port: int, attempt: int, store: str) -> Dict[str, str]:
    """One rank's environment: ``worker_env()``, torchrun's contract, the kit's variables, then ``spec.env``.

    Args:
        store: for rank 0, how its bootstrap hosts the store: ``"fd:N"`` (the
            socket ``launch`` bound) or ``"bind"`` (bind MASTER_PORT itself);
            ``"join"`` for the other ranks.
    """
    env = worker_env()
    world = str(spec.world_size)
    env.update({
        # torchrun's contract, for one node
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": net.LOOPBACK, "MASTER_PORT": str(port),
        envvars.RESTART_COUNT: str(attempt), envvars.MAX_RESTARTS: str(spec.max_restarts),
        # Rank 0's bootstrap hosts the store on a loopback socket, so env:// must not
        # start a second server (on all interfaces): every rank connects as a client.
        envvars.USE_AGENT_STORE: "True",
        # ours
        envvars.RUN_DIR: str(spec.run_dir), envvars.BACKEND: spec.backend,
        envvars.LAUNCHER_PID: str(os.getpid()), envvars.STORE: store,
    })
    env.update(spec.env)
    return env


def start_attempt(spec: LaunchSpec, number: int, cold_reason: Optional[str], deadline: float) -> Attempt:
    """Start one attempt's ranks; rank 0 gets the store's listening socket (or binds ``spec.master_port``).

    Args:
        cold_reason: ``cold_reason(spec)``: None to fork the ranks from the fork server if it can.
        deadline: the launch's (a fork server still starting is waited for within it).
    """
    while True:
        try:
            sock = None if spec.master_port else net.listen_socket()
        except OSError as exc:
            raise LaunchError(f"could not open a listening socket on {net.LOOPBACK}: {exc}") from exc
        try:
            port = spec.master_port or sock.getsockname()[1]
            store = "bind" if sock is None else f"fd:{sock.fileno()}"
            envs = [rank_env(spec, r, port, number, store if r == 0 else "join") for r in range(spec.world_size)]
            server = None
            if cold_reason is None:
                server, cold_reason = warmstart.acquire(spec.cmd, envs, deadline)
            try:
                group = WorkerGroup(spec.cmd, envs, spec.echo, None if sock is None else sock.fileno(), server)
            except warmstart.ServerUnavailable as exc:  # the group released the server
                # Never a failed launch because of the server: start cold, with a new socket
                # (the one given to the stopped rank 0 may hold its dead connections).
                cold_reason = f"the fork server failed: {exc}"
                continue
        finally:
            if sock is not None:
                sock.close()  # rank 0 holds it now: the port is free again once rank 0 exits
        mode, why = ("warm", None) if server is not None else ("cold", cold_reason)
        attempt = Attempt(number, group, port, mode, why)
        runfolder.note_start(spec.run_dir, number, attempt.start_mode, attempt.cold_reason)
        return attempt


def prestart_fork_server() -> bool:
    """Start the fork server for this process's launches now, without waiting for it.

    ``import ddp_tutorial`` calls it in a Jupyter kernel, so that even the first launch
    cell is warm. True if a server was started (see ``warmstart.prestart``).
    """
    default = LaunchSpec(target=(), world_size=1, run_dir=Path.cwd(), backend="gloo")
    return warmstart.prestart(rank_env(default, 0, 0, 0, "bind"))  # as a default launch's rank 0


def fork_server_ready(timeout: float = warmstart.START_S) -> bool:
    """Start the fork server (if none runs) and wait until it has imported torch; True if it is ready.

    A launch's deadline counts from its call; a first warm launch waits for the server within
    that deadline. Waiting here first keeps torch's import out of a short deadline (a check, a test).
    """
    prestart_fork_server()
    server = warmstart._SERVER
    return server is not None and server.wait_ready(time.monotonic() + timeout)


# -- Scripts that must start cold -----------------------------------------------------
def environment_before_torch(target: Sequence[str]) -> Optional[str]:
    """Why a script must start cold because it sets environment variables before ``import torch``; else None.

    torch reads some variables once, when it is imported (OMP_NUM_THREADS sizes its thread
    pool): in a warm rank torch was imported by the fork server, before the script ran, so
    such a setting would silently do nothing. Looks at the script's top-level statements
    up to its first ``import torch``.

    Args:
        target: the command's target, ``[path]`` or ``["-m", module]``.
    """
    try:
        if target[0] == "-m":
            spec = importlib.util.find_spec(target[1])
            path = spec.origin if spec is not None else None
        else:
            path = target[0]
        if not path or not path.endswith(".py"):
            return None
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError, ImportError):
        return None  # the rank will report what is wrong with it
    for stmt in tree.body:
        if _imports_torch(stmt):
            return None
        if _changes_environment(stmt):
            return (f"{Path(path).name} sets environment variables before importing torch (line {stmt.lineno}); "
                    f"in a warm rank torch is imported already, so they would not take effect")
    return None


_ENV_METHODS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _changes_environment(node: ast.AST) -> bool:
    """Whether ``node`` writes ``os.environ`` (or calls ``os.putenv``/``unsetenv``) when it runs."""
    def is_environ(n):
        return (isinstance(n, ast.Attribute) and n.attr == "environ") or (isinstance(n, ast.Name)
                                                                           and n.id == "environ")

    def runs_now(n):  # every node that runs with the statement: not the bodies of functions it defines
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.iter_child_nodes(n):
                yield from runs_now(child)

    for n in runs_now(node):
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else (
            [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        if any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in targets):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if is_environ(n.func.value) and n.func.attr in _ENV_METHODS:
                return True
            if n.func.attr in ("putenv", "unsetenv") and isinstance(n.func.value, ast.Name) and n.func.value.id == "os":
                return True
    return False


def _imports_torch(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "torch" or a.name.startswith("torch.") for a in node.names)
    return isinstance(node, ast.ImportFrom) and bool(node.module) and (
        node.module == "torch" or node.module.startswith("torch."))
