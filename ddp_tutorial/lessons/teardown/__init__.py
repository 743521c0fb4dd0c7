"""Notebook 05's helpers: destroy_process_group, a crashing rank, a dead peer (no torch here)."""

from __future__ import annotations

from typing import Dict

from ddp_tutorial.launcher import launch
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.runfolder import Run

TEARDOWN_SCRIPT = worker_script(__file__, "teardown_demo.py")
PEER_EXIT_SCRIPT = worker_script(__file__, "peer_exit_demo.py")


def run_teardown_demo(world_size: int = 2, echo: str = "all", timeout: float = 60.0) -> Run:
    """Launch ``teardown_demo.py``: init twice, destroy, init again, on every rank."""
    return launch(TEARDOWN_SCRIPT, world_size, echo=echo, timeout=timeout)


def teardown_results(run: Run) -> Dict[int, Dict[str, object]]:
    """rank -> what ``teardown_demo.py`` reported."""
    return {rank: run.results(rank)[-1] for rank in run.ranks}


def peer_gone(world_size: int = 2, pg_timeout: float = 60.0, timeout: float = 90.0) -> dict:
    """Launch ``peer_exit_demo.py``: the last rank vanishes; rank 0's report of how fast its
    all_reduce failed."""
    run = launch(PEER_EXIT_SCRIPT, world_size, ["--pg-timeout", str(pg_timeout)], echo="none",
                 timeout=timeout)
    return run.results(0)[-1]


def exit_without_teardown(world_size: int = 2, timeout: float = 60.0) -> Run:
    """Launch ``peer_exit_demo.py --no-teardown``: ranks return without leaving the group."""
    return launch(PEER_EXIT_SCRIPT, world_size, ["--no-teardown"], echo="all", timeout=timeout)
