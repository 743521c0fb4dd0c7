"""Shared fixtures: every test's runs go to a temporary folder, and orphan checks."""

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def runs_root(tmp_path, monkeypatch):
    """Launches without run_dir write under this test's own folder."""
    root = tmp_path / "runs"
    monkeypatch.setenv("DDP_TUTORIAL_RUNS", str(root))
    return root


def processes_of_run(run_dir) -> list:
    """Pids of live processes started for ``run_dir`` (found by their environment).

    Independent of the launcher's own bookkeeping: it scans /proc for any
    process, child or grandchild, whose DDP_TUTORIAL_RUN_DIR is this run's.
    """
    needle = f"DDP_TUTORIAL_RUN_DIR={Path(run_dir).resolve()}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if needle in env and state != b"Z":
            found.append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def _leftovers(base: Path) -> list:
    """Live processes whose run folder (DDP_TUTORIAL_RUN_DIR) lies under ``base``: ranks, or what they started."""
    needle = f"DDP_TUTORIAL_RUN_DIR={base.resolve()}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if any(e.startswith(needle) for e in env) and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if any process a test started for a run folder is still alive at the end."""
    import time

    if hasattr(session.config, "workerinput"):
        # A pytest-xdist worker: its base folder lies under the controller's, which checks
        # after every worker has finished (a worker's exit status would not fail the run).
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or not os.path.isdir("/proc"):
        return
    base = factory.getbasetemp()
    end = time.monotonic() + 10  # a SIGKILL takes effect when the process next runs
    left = _leftovers(base)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = _leftovers(base)
    if left:
        cmdlines = []
        for pid in left:
            try:
                cmdlines.append(f"{pid}: " + open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
            except OSError:
                pass
        print("\nprocesses the tests started and left running:\n" + "\n".join(cmdlines))
        for pid in left:  # do not leave them for the next run either
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        session.exitstatus = 1
