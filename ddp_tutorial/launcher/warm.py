"""Warm ranks (optional): forked by Python's own forkserver, which has imported torch once.

A cold rank pays for ``import torch`` at every launch. A warm rank is forked
from ``multiprocessing``'s forkserver after it imported torch (``set_forkserver_preload``), so a
launch costs little more than the script's own work. The forked child then makes itself
what a cold rank is (``bootstrap.py``'s ``run_warm``): a session of its own, its output on
a socket to ``launch``, the rank's environment, and the script run as ``__main__``.

One switch decides (``use_warm``): ``launch(warm=...)``, else ``DDP_TUTORIAL_WARM`` ("1"/"0"),
else warm on Linux and cold elsewhere. On macOS Python itself starts processes by spawn,
since ``fork()`` after Apple's system frameworks have loaded can crash the child
(docs/platforms.md). nccl launches start cold (CUDA must not be initialised before a fork).
What differs from a cold rank: torch was imported before the script ran, so an
environment variable the script sets before ``import torch`` comes too late for settings
torch reads at import. ``warm=False`` gives the exact torchrun behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
from multiprocessing import spawn
import runpy
import socket
import sys
from typing import Dict, List, Optional

from ddp_tutorial import envvars
from ddp_tutorial.launcher.spec import BOOTSTRAP

#: What the forkserver imports before it forks any rank. Not ``torch._dynamo`` (which DDP's
#: constructor imports): with it imported before ``init_process_group`` (which then clears
#: dynamo's caches, torch/distributed/distributed_c10d.py), a DDP model freed after
#: ``destroy_process_group`` can deadlock where a cold rank does not (docs/warm-launches.md).
#: A warm rank must meet what a cold one meets.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "ddp_tutorial.envvars"]

#: Variables torch may read once, when it is imported: a launch that sets one starts cold, since the
#: forkserver imported torch without it (TORCH_DISTRIBUTED_DEBUG, for one, is read then).
READ_AT_IMPORT = ("TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_")


def use_warm(warm: Optional[bool], backend: str, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """None if this launch's ranks start warm, else why they start cold.

    Args:
        env: the variables the launch sets for its ranks (``launch(env=...)``).
    """
    if backend == "nccl":
        return "nccl launches start cold"
    at_import = sorted(k for k in env or {} if k.startswith(READ_AT_IMPORT) and k != "OMP_NUM_THREADS")
    if at_import:
        return f"the launch sets {', '.join(at_import)}, which torch may read when it is imported"
    if warm is None:
        setting = os.environ.get(envvars.WARM, "")
        if setting in ("0", "1"):
            warm = setting == "1"
        elif not sys.platform.startswith("linux"):
            return f"ranks start cold on {sys.platform} ({envvars.WARM}=1 forks them warm)"
        else:
            warm = True
    return None if warm else f"warm launches are turned off (warm=False or {envvars.WARM}=0)"


@functools.lru_cache(maxsize=None)
def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its preload set (once per process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def _without_main():
    """While a rank starts: the forkserver's child does not import the launching program's ``__main__``.

    multiprocessing re-runs it in every child (as ``__mp_main__``), so a script that calls
    ``launch`` outside an ``if __name__ == "__main__":`` block would launch again from every
    rank; a rank under torchrun runs only its own script. ``Popen._launch`` reads
    ``spawn.get_preparation_data`` by name, for each start: it is swapped for one start only.
    """
    with_main = spawn.get_preparation_data

    def without_main(name):
        data = with_main(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = with_main


class WarmRank:
    """A rank forked by the forkserver, with the parts of ``subprocess.Popen`` that ``launch`` uses.

    ``stdout`` is the launcher's end of a socket pair; the rank writes its stdout and stderr
    to the other end. ``sentinel`` becomes readable when the rank exits.
    """

    def __init__(self, argv: List[str], env: Dict[str, str], store: Optional[socket.socket],
                 launcher_end: socket.socket, peers: Optional[socket.socket] = None):
        self.stdout, rank_end = socket.socketpair()
        # Sockets travel to the forkserver's child as descriptors (multiprocessing.reduction).
        sockets = {"out": rank_end, "launcher": launcher_end, "store": store, "peers": peers}
        self._process = context().Process(
            target=runpy.run_path, args=(BOOTSTRAP,),
            kwargs={"run_name": "__ddp_tutorial_warm__", "init_globals": {"WARM_RANK": (argv, env, sockets)}})
        try:
            with _without_main():
                self._process.start()
        finally:
            rank_end.close()
        self.pid = self._process.pid
        self.sentinel = self._process.sentinel
        self.returncode: Optional[int] = None

    def exited(self) -> bool:
        """Whether it exited, its exit code left unread (``returncode`` stays None, and so
        ``procgroup`` may still signal its group: the rank's pid cannot lead another's yet)."""
        return self.returncode is not None or bool(multiprocessing.connection.wait([self.sentinel], 0))

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._process._popen.poll()
            if self.returncode is not None:
                self._process.close()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self._process.join(timeout)
        return self.poll()


def ready(timeout: float) -> bool:
    """Wait (up to ``timeout`` s) until the forkserver has imported ``PRELOAD``: it forks nothing before."""
    probe = context().Process(target=int)
    with _without_main():
        probe.start()
    probe.join(timeout)
    done = probe.exitcode == 0
    if probe.exitcode is None:
        probe.kill()
        probe.join()
    probe.close()
    return done


def helper_pids() -> set:
    """The pids of the processes multiprocessing keeps for warm launches: its forkserver and
    resource tracker (children of this process that are not ranks)."""
    from multiprocessing import forkserver, resource_tracker

    return {pid for pid in (getattr(forkserver._forkserver, "_forkserver_pid", None),
                            getattr(resource_tracker._resource_tracker, "_pid", None)) if pid}


def prestart_warm() -> None:
    """In a notebook: start the forkserver while the learner reads (if this process's launches are warm)."""
    if use_warm(None, "gloo") is None:
        from multiprocessing import forkserver

        context()
        forkserver.ensure_running()


def warm_ready(timeout: float = 60.0) -> bool:
    """Start the forkserver (if launches are warm) and wait until it has imported torch; True if ready.

    A launch's deadline counts from its call: waiting here first keeps torch's import out of a
    short deadline (a check, a test). False where launches start cold.
    """
    return use_warm(None, "gloo") is None and ready(timeout)
