"""What every pitfall's helpers share: launching the scripts, and reading their records back."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

from ddp_tutorial.launcher import LaunchError, launch
from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.lessons import script_source
from ddp_tutorial.runfolder import Run


PITFALLS = ("batchnorm", "unused", "checkpoint", "evaluation", "seeding", "lr", "clipping", "hang")


def script(name: str) -> str:
    """Path of the worker script of pitfall ``name`` (one of ``PITFALLS``)."""
    if name not in PITFALLS:
        raise ValueError(f"no pitfall {name!r}; one of {', '.join(PITFALLS)}")
    return worker_script(__file__, f"pitfall_{name}.py")


def show(name: str, function: str) -> None:
    """Print the source of ``function`` in pitfall ``name``'s worker script (read, not imported)."""
    print(script_source(script(name), function))


# -- Launching ---------------------------------------------------------------------
def run_pitfall(name: str, world_size: int = 2, args: Sequence = (), timeout: float = 120.0,
                echo: str = "none", **launch_kwargs) -> Run:
    """Launch pitfall ``name``'s script with ``args`` on ``world_size`` ranks."""
    return launch(script(name), world_size, [str(a) for a in args], timeout=timeout, echo=echo,
                  **launch_kwargs)


#: The pitfalls that run on 2 ranks and finish: one launch runs them all (``run_lab``).
LAB = ("batchnorm", "unused", "checkpoint", "seeding", "lr", "clipping")


def run_lab(pitfalls: Sequence[str] = LAB, world_size: int = 2, timeout: float = 180.0,
            **launch_kwargs) -> Run:
    """Launch ``pitfall_lab.py``: the ``pitfalls``' scripts in turn on one set of ranks, each
    reporting as it does alone (one start of the ranks instead of one per pitfall)."""
    for name in pitfalls:
        script(name)  # refuses an unknown name before anything starts
    return launch(worker_script(__file__, "pitfall_lab.py"), world_size, list(pitfalls),
                  timeout=timeout, echo="none", **launch_kwargs)


def expect_failure(name: str, world_size: int = 2, args: Sequence = (), timeout: float = 120.0,
                   env: Optional[Dict[str, str]] = None) -> LaunchError:
    """Launch a run that must fail; return its ``LaunchError``, with ``seconds`` it took
    (RuntimeError if the launch finished cleanly: the pitfall did not happen)."""
    t0 = time.monotonic()
    try:
        run_pitfall(name, world_size, args, timeout=timeout, env=env)
    except LaunchError as err:
        err.seconds = time.monotonic() - t0
        return err
    raise RuntimeError(f"pitfall_{name}.py {' '.join(map(str, args))} finished without failing")


def records(run: Run, pitfall: str, name: str, rank: int) -> List[dict]:
    """What ``rank`` reported for part ``name`` of ``pitfall``, in order."""
    return [rec for rec in run.results(rank)
            if rec.get("pitfall") == pitfall and rec.get("part") == name]


def part(run: Run, pitfall: str, name: str, rank: int = 0) -> dict:
    """The last record of part ``name`` of ``pitfall`` that ``rank`` reported (KeyError if none)."""
    found = records(run, pitfall, name, rank)
    if not found:
        raise KeyError(f"rank {rank} reported no part {name!r} of {pitfall!r} in {run.run_dir}")
    return found[-1]


def per_rank(run: Run, pitfall: str, name: str) -> Dict[int, dict]:
    """Rank -> its last record of part ``name`` of ``pitfall``, for the ranks that reported one."""
    found = {rank: records(run, pitfall, name, rank) for rank in range(run.world_size)}
    return {rank: recs[-1] for rank, recs in found.items() if recs}


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest absolute difference between two equally long lists of numbers."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))  # ValueError if lengths differ


def ranks_agree(records: Dict[int, dict], key: str) -> bool:
    """Did every rank report the same ``key``?"""
    return len({str(rec[key]) for rec in records.values()}) == 1
