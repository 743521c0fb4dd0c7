"""What ``launch`` raises, and a rank's exit and output in words. Every error is a ``LaunchError``
carrying the partial ``Run`` (``.run``) where ranks had started: a notebook can still plot it."""

from __future__ import annotations

import signal
from typing import List, Optional

from ddp_tutorial.runfolder import Run


class LaunchError(RuntimeError):
    """Base class of every error ``launch`` raises; ``run``: the partial ``Run``, or None."""

    def __init__(self, message: str, run: Optional[Run] = None):
        super().__init__(message)
        self.run = run


class LaunchConfigError(LaunchError, ValueError):
    """Bad input, found before any process started and before any folder was made."""


class WorkerError(LaunchError):
    """A rank raised or exited non-zero; every other rank was stopped. ``rank``: the one that
    failed first; ``exit_code``: its exit code (negative: killed by that signal); ``traceback``:
    its output from its last traceback on; ``failed_after``: the others that failed on their own."""

    def __init__(self, message, rank, exit_code, traceback, run=None, failed_after=()):
        super().__init__(message, run)
        self.rank, self.exit_code, self.traceback = rank, exit_code, traceback
        self.failed_after = list(failed_after)


class LaunchTimeout(LaunchError, TimeoutError):
    """The deadline passed with ranks still running; all were stopped. Per rank: ``still_running``
    (the last micro-step it finished, or None), ``stacks`` (its script's Python stack when stopped,
    most recent call first), ``waiting_in`` (the torch.distributed call it was in, or None)."""

    def __init__(self, message, still_running, run=None, stacks=None, waiting_in=None):
        super().__init__(message, run)
        self.still_running = still_running
        self.stacks = dict(stacks or {})
        self.waiting_in = dict(waiting_in or {})


def describe_exit(code: int) -> str:
    """An exit status in words: "exit code 3", or "killed by SIGKILL" for a negative one."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def last_traceback(lines: List[str], max_lines: int = 40) -> str:
    """The rank's last Python traceback (its output, torch's ``[rankN]:`` removed: ``start``), or
    the tail of its output."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            return "\n".join(lines[i:i + max_lines])
    return "\n".join(lines[-15:]) or "(no output)"
