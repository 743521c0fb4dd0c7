"""Warm ranks (optional): forked by multiprocessing's forkserver, which imported torch once
(``set_forkserver_preload``); each then makes itself what a cold rank is (``bootstrap.run_warm``).
One switch decides (``use_warm``); docs/warm-launches.md: how they differ, why macOS starts cold."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import sys
from multiprocessing import forkserver, spawn
from typing import Dict, List, Optional

from ddp_tutorial import envvars
from ddp_tutorial.launcher.spec import BOOTSTRAP

#: What the forkserver imports before it forks. Not ``torch._dynamo`` nor what it imports (sympy,
#: DTensor...): imported before ``init_process_group``, they make a DDP model freed after
#: ``destroy_process_group`` hang now and then where torchrun's ranks did not (docs/measured.md).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "ddp_tutorial.envvars"]
#: Variables torch may read when imported (TORCH_DISTRIBUTED_DEBUG...): a launch setting one starts
#: cold, since the forkserver imported torch without it.
READ_AT_IMPORT = ("TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_")


def use_warm(warm: Optional[bool], backend: str, env: Optional[Dict] = None) -> Optional[str]:
    """None if this launch's ranks start warm, else why cold (``env``: ``launch(env=...)``)."""
    if backend == "nccl":
        return "nccl launches start cold"  # CUDA must not be initialised before a fork
    at_import = sorted(k for k in env or {}
                       if k.startswith(READ_AT_IMPORT) and k != "OMP_NUM_THREADS")
    if at_import:
        return f"the launch sets {', '.join(at_import)}, which torch may read when it is imported"
    setting = os.environ.get(envvars.WARM, "")
    if warm is None and setting in ("0", "1"):
        warm = setting == "1"
    elif warm is None and not sys.platform.startswith("linux"):  # docs/platforms.md
        return f"ranks start cold on {sys.platform} ({envvars.WARM}=1 forks them warm)"
    if warm is False:
        return f"warm launches are turned off (warm=False or {envvars.WARM}=0)"
    return None


@functools.lru_cache(maxsize=None)
def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its preload set (once per process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def _without_main():
    """The forkserver's child does not re-run the launching program's ``__main__``: a script calling
    ``launch`` without ``if __name__ == "__main__":`` launches once. (``Popen._launch`` reads
    ``spawn.get_preparation_data`` at each start: swapped for one start only.)"""
    with_main = spawn.get_preparation_data

    def without_main(name):
        return {k: v for k, v in with_main(name).items() if not k.startswith("init_main_from_")}

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = with_main


class WarmRank:
    """A rank forked by the forkserver, with what ``launch`` uses of ``subprocess.Popen``;
    ``stdout``: our end of the socket pair the rank writes its output to."""

    def __init__(self, argv: List[str], env: Dict[str, str], store: Optional[socket.socket],
                 launcher_end: socket.socket, peers: Optional[socket.socket] = None):
        self.stdout, rank_end = socket.socketpair()
        # Sockets travel to the child as descriptors (multiprocessing.reduction).
        sockets = {"out": rank_end, "launcher": launcher_end, "store": store, "peers": peers}
        globs = {"WARM_RANK": (argv, env, sockets)}
        self._process = context().Process(target=runpy.run_path, args=(BOOTSTRAP,), kwargs={
            "run_name": "__ddp_tutorial_warm__", "init_globals": globs})
        try:
            with _without_main():
                self._process.start()
        finally:
            rank_end.close()
        self.pid = self._process.pid
        self.returncode: Optional[int] = None

    def exited(self) -> bool:
        """Whether it exited; ``returncode`` stays None (``procgroup`` may signal its group)."""
        sentinel = self._process.sentinel
        return self.returncode is not None or bool(multiprocessing.connection.wait([sentinel], 0))

    def wait(self) -> int:
        """Reap it, once it has exited (``procgroup.end``)."""
        if self.returncode is None:
            self._process.join()
            self.returncode = self._process.exitcode
            self._process.close()
        return self.returncode


def prestart_warm() -> None:
    """In a notebook: start the forkserver while the learner reads (if launches are warm)."""
    if use_warm(None, "gloo") is None:
        context()
        forkserver.ensure_running()


def warm_ready(timeout: float = 60.0) -> bool:
    """Start the forkserver (if launches are warm) and wait until it has imported ``PRELOAD``
    (True; False where launches start cold): keeps torch's import out of a short deadline."""
    if use_warm(None, "gloo") is not None:
        return False
    probe = context().Process(target=int)  # the forkserver forks nothing before it has imported
    with _without_main():
        probe.start()
    probe.join(timeout)
    done = probe.exitcode == 0
    if probe.exitcode is None:
        probe.kill()
        probe.join()
    probe.close()
    return done
