"""An exercise's run in a session of its own: a plain process, or torchrun, under ``guard.py``.

``guard.py`` leads the session and kills its group once this process is gone (the launcher's watch
socket, which a rank's bootstrap watches too); ``stop`` stops what is left, strays included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List

from ddp_tutorial.launcher import procgroup, procinfo
from ddp_tutorial.launcher.start import launcher_watch


def start(cmd: List[str], env, cwd, output) -> subprocess.Popen:
    """Start ``cmd`` in a new session under ``guard.py``, its output into the file ``output``."""
    watch = launcher_watch().fileno()
    guard = str(Path(__file__).with_name("guard.py"))
    return subprocess.Popen([sys.executable, "-I", "-S", guard, str(watch), *cmd], env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True, pass_fds=(watch,))


def wait_for_exit(p: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s until ``p`` exits, without reaping it (its group id stays ours)."""
    return procgroup.wait_until(lambda: procgroup.has_exited(p), timeout)


def stop(p: subprocess.Popen, strays: Iterable[int] = (), grace: float = 3.0) -> None:
    """SIGTERM to the session's group (torchrun stops its ranks), SIGKILL to what is left after
    ``grace`` s, then SIGKILL to the groups of ``strays``, the pids of processes that left it
    (torchrun starts each rank in a session of its own)."""
    procgroup.killpg(p, signal.SIGTERM)
    wait_for_exit(p, grace)
    procgroup.end(p)
    strays = [pid for pid in strays if procinfo.alive(pid)]
    for pid in strays:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    gone = lambda: not any(procinfo.alive(pid) for pid in strays)  # noqa: E731
    procgroup.wait_until(gone, procgroup.KILL_WAIT_S)
