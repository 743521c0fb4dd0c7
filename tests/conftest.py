"""Shared fixtures: every test's runs go to a temporary folder, and orphan checks."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

import psutil

from ddp_tutorial.launcher import procinfo

# Thousands of processes import the kit during a run (ranks, notebook kernels, checks). Where
# PYTHONDONTWRITEBYTECODE is set (some machine images set it), each would compile the kit from
# source again: the suite lets them cache its bytecode (``__pycache__/``, ignored by git), as
# Python does by default. Nothing else changes for them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(autouse=True)
def runs_root(tmp_path, monkeypatch):
    """Launches without run_dir write under this test's own folder."""
    root = tmp_path / "runs"
    monkeypatch.setenv("DDP_TUTORIAL_RUNS", str(root))
    return root


def processes_of_run(run_dir, prefix: bool = False) -> list:
    """Pids of live processes started for ``run_dir`` (or, with ``prefix``, any run folder under it).

    Two ways, neither the launcher's own supervision: every process whose environment
    started with a DDP_TUTORIAL_RUN_DIR that is this run's (a cold rank, torchrun and its
    ranks, what they started), and every member of the process groups of the ranks the run
    folder lists (a warm rank, forked with the forkserver's environment, and what it started).
    """
    folder = Path(run_dir).resolve()
    found = set(pids_with_env("DDP_TUTORIAL_RUN_DIR", str(folder), prefix=prefix))
    claims = folder.rglob(".launch.json") if prefix else [folder / ".launch.json"]
    for claim in claims:
        try:
            pids = json.loads(claim.read_text()).get("pids", {})
        except (OSError, ValueError):
            continue
        for leader in (pid for attempt in pids.values() for pid in attempt):
            found.update(p for p in [leader, *procinfo.group_members(leader)]
                         if procinfo.alive(p) and procinfo.group(p) == leader)
    return sorted(found)


pid_alive = procinfo.alive  # the name the tests import


def cmdline(pid):
    """The argv of ``pid``; None if it is gone (or a zombie, whose argv is empty)."""
    try:
        return psutil.Process(pid).cmdline() or None
    except psutil.Error:
        return None


def pids_with_env(name: str, value: str, prefix: bool = False) -> list:
    """Live processes, this one aside, whose variable ``name`` is ``value`` (or starts with it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            got = proc.environ().get(name) if proc.pid != os.getpid() else None
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
        matches = got is not None and (got.startswith(value) if prefix else got == value)
        if matches and pid_alive(proc.pid):
            found.append(proc.pid)
    return found


@contextlib.contextmanager
def only_checks(cpu_s: float = 1.0, wall_s: float = 10.0):
    """The block only checks its input: under ``cpu_s`` of this process's CPU, which a busy machine
    does not stretch (its wall clock does: 1.3 s seen for what was a 1 s wall bound), and under
    ``wall_s`` of wall time, which rules out waiting (for the fork server, a deadline or a peer).
    That it starts nothing is checked apart: no process and no run folder left."""
    wall0, cpu0 = time.monotonic(), time.process_time()
    yield
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert cpu < cpu_s, f"{cpu:.2f} s of CPU: more than checking costs"
    assert wall < wall_s, f"{wall:.1f} s: it waited for something"


#: The order in which the pytest-xdist workers take modules and notebooks (``--dist loadscope
#: --no-loadscope-reorder``: the next one goes to whichever worker is free, in this order; everything
#: else follows in collection order). The longest first (by ``pytest --durations=0``), so the short
#: ones at the end even out the workers' finishing times.
LONG_ONES_FIRST = (
    "tests/test_exercise_my_ddp.py",
    "tests/test_exercises.py",
    "tests/test_beyond_one_machine.py",
    "tests/test_exercise_shard.py",
    "tests/test_grade.py",
    "tests/test_slurm.py",
    "tests/test_teardown_order.py",
    "tests/test_hardening.py",
    "tests/test_bench.py",
    "tests/test_launcher.py",
    "tests/test_lessons_init_wrap.py",
    "notebooks/11_build_your_own_ddp.ipynb",
    "notebooks/06_capstone_port_a_script.ipynb",
    "notebooks/08_beyond_one_machine.ipynb",
    "notebooks/10_beyond_ddp_sharding.ipynb",
    "notebooks/05_teardown.ipynb",
    "tests/test_train.py",
)


def pytest_collection_modifyitems(config, items):
    place = {name: i for i, name in enumerate(LONG_ONES_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::")[0], len(place)))  # stable: the rest keep their order


def _leftovers(base: Path) -> list:
    """Live processes whose run folder (DDP_TUTORIAL_RUN_DIR) lies under ``base``: ranks, or what they started."""
    return processes_of_run(base, prefix=True)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if any process a test started for a run folder is still alive at the end."""
    import time

    if hasattr(session.config, "workerinput"):
        # A pytest-xdist worker: its base folder lies under the controller's, which checks
        # after every worker has finished (a worker's exit status would not fail the run).
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    base = factory.getbasetemp()
    # A SIGKILL takes effect when the process next runs, and a launcher's keeper may be about to
    # send one: wait for them. tests/test_leftover_check.py's inner sessions leave one on purpose
    # and need not wait that long to prove that it fails the session.
    end = time.monotonic() + float(os.environ.get("DDP_TUTORIAL_TEST_LEFTOVER_WAIT_S", "10"))
    left = _leftovers(base)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = _leftovers(base)
    if left:
        cmdlines = [f"{pid}: " + " ".join(cmdline(pid) or ["(gone)"]) for pid in left]
        print("\nprocesses the tests started and left running:\n" + "\n".join(cmdlines))
        for pid in left:  # do not leave them for the next run either
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        session.exitstatus = 1
