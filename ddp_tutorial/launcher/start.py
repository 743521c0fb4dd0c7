"""How one attempt starts: warm or cold, each rank's environment, and the store's socket for rank 0.

``start_attempt`` starts the ranks of one attempt and returns an ``Attempt``, which
holds every fact of how it started; ``warm.use_warm`` decides, once per launch, whether
they are forked warm or start as new processes, and says why.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional

from ddp_tutorial import envvars, runfolder
from ddp_tutorial.launcher import net, warm
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


_WATCH: List[socket.socket] = []  # (launcher's end, ranks' end), made once per process
_WATCH_OWNER: List[int] = []


def launcher_watch() -> socket.socket:
    """The ranks' end of a socket pair whose other end only this process holds: it reads
    end-of-file once this process is gone, however it ended, and the ranks then kill their groups."""
    if _WATCH_OWNER != [os.getpid()]:  # none yet, or we are a fork: our parent's is not ours
        _WATCH[:] = socket.socketpair()
        _WATCH_OWNER[:] = [os.getpid()]
    return _WATCH[1]


def worker_env() -> Dict[str, str]:
    """The environment every process the kit starts to run a script begins with.

    This process's environment without an outer launcher's variables (torchrun's
    contract, ``TORCHELASTIC_*``, the kit's own per-launch ones: a check run inside a
    rank must not look like that rank), the package on PYTHONPATH, unbuffered output,
    gloo's and nccl's sockets on loopback, and one thread unless asked otherwise.
    """
    outer = set(envvars.TORCHRUN_CONTRACT) | {envvars.STORE, envvars.LAUNCHER_FD}
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
        envvars.STORE: store,
    })
    env.update(spec.env)
    return env


def start_attempt(spec: LaunchSpec, number: int, cold_reason: Optional[str]) -> Attempt:
    """Start one attempt's ranks; rank 0 gets the store's listening socket (or binds ``spec.master_port``).

    Args:
        cold_reason: ``warm.use_warm``'s answer: None forks the ranks warm.
    """
    try:
        sock = None if spec.master_port else net.listen_socket()
    except OSError as exc:
        raise LaunchError(f"could not open a listening socket on {net.LOOPBACK}: {exc}") from exc
    try:
        port = spec.master_port or sock.getsockname()[1]
        store = "bind" if sock is None else f"fd:{sock.fileno()}"
        envs = [rank_env(spec, r, port, number, store if r == 0 else "join") for r in range(spec.world_size)]
        group = WorkerGroup(spec.cmd, envs, spec.echo, sock, launcher_watch(), warm_start=cold_reason is None)
    finally:
        if sock is not None:
            sock.close()  # rank 0 holds it now: the port is free again once rank 0 exits
    mode = "warm" if cold_reason is None else "cold"
    runfolder.note_start(spec.run_dir, number, mode, cold_reason, group.pids)
    return Attempt(number, group, port, mode, cold_reason)


def prestart_warm() -> None:
    """In a notebook: start the forkserver while the learner reads (if this process's launches are warm)."""
    if warm.use_warm(None, "gloo") is None:
        warm.prestart()


def warm_ready(timeout: float = 60.0) -> bool:
    """Start the forkserver (if launches are warm) and wait until it has imported torch; True if ready.

    A launch's deadline counts from its call: waiting here first keeps torch's import out of a
    short deadline (a check, a test). False where launches start cold.
    """
    return warm.use_warm(None, "gloo") is None and warm.ready(timeout)
