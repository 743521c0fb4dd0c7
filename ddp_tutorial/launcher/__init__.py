"""Start one OS process per rank from a script file, and guard them from the notebook.

``launch`` is what a notebook cell calls. It gives the workers torchrun's
environment contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT=<a port it holds>), streams their output as ``[rank r] ...``, and
returns a ``Run`` with each rank's metrics. It never pickles notebook code and
never forks the kernel: each rank is ``python <script>`` in a new process (cold), or,
warm (the default on Linux), forked from Python's forkserver, which has imported torch,
and then set up as that new process would be (``warm``). torch itself is never changed.

The fault contract: the first rank that fails stops the whole group
(``WorkerError`` with its traceback); a deadline turns a hang into
``LaunchTimeout``; an interrupt stops every worker; no worker outlives a launch.
Every input is checked before anything starts (``LaunchConfigError``).

Split as torchrun splits its agent (a spec, a worker group, the loop that watches
it); read the modules in this order (docs/how-it-is-built.md follows one launch through them):

- ``spec``: ``LaunchSpec``, every argument checked once; the run folder claimed.
- ``supervise``: the loop: attempts, fail-fast, deadlines, restarts, interrupts; the ``Run``.
- ``start``: one attempt: each rank's environment, the store's socket (``net``), the launcher's watch.
- ``warm``: the optional warm start (``multiprocessing``'s forkserver).
- ``workergroup``: one attempt's ranks, their output and exits, on one poll.
- ``procgroup``: a rank's process group: start, signal, sweep; ``guard.py`` for a session.
- ``procinfo``: what a process is (psutil: every question the kit asks about one).
- ``errors``: what ``launch`` raises.

This package imports no torch, so a launch costs the kernel nothing up front.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

from ddp_tutorial.launcher.errors import (LaunchConfigError, LaunchError, LaunchTimeout, WorkerError,
                                          describe_exit, port_taken)
from ddp_tutorial.launcher.net import LOOPBACK, free_port, loopback_interface
from ddp_tutorial.launcher.spec import (BOOTSTRAP, MAX_WORLD_SIZE, LaunchSpec, check_args_with, scripts_path,
                                       worker_script)
from ddp_tutorial.launcher.start import prestart_warm, warm_ready
from ddp_tutorial.launcher.supervise import run_attempts
from ddp_tutorial.runfolder import Run

__all__ = ["launch", "Run", "LaunchSpec", "LaunchError", "LaunchConfigError", "WorkerError", "LaunchTimeout",
           "describe_exit", "port_taken", "free_port", "loopback_interface", "LOOPBACK",
           "BOOTSTRAP", "MAX_WORLD_SIZE", "check_args_with", "scripts_path", "worker_script",
           "prestart_warm", "warm_ready"]


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
        warm: True forks the ranks from Python's forkserver, which keeps torch imported
            (``launcher/warm.py``); False starts each rank as a new process, exactly as torchrun
            would; None (default): ``DDP_TUTORIAL_WARM`` ("1"/"0") if set, else warm on Linux and
            cold elsewhere. nccl starts cold all the same; ``run.start_mode`` says which it was.

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
    spec = LaunchSpec.build(script, world_size, args, timeout=timeout, backend=backend, run_dir=run_dir,
                            env=env, echo=echo, max_restarts=max_restarts, master_port=master_port,
                            grace=grace, warm=warm)
    return run_attempts(spec, t0)
