"""Notebook 08's helpers (beyond one machine); it mostly launches train.py itself.

``workers/uneven_join.py`` shows uneven inputs with and without ``Join``; ``workers/gpu_check.sh``
checks the nccl path on a GPU machine; ``slurm/`` holds the sbatch script.
"""

from pathlib import Path

from ddp_tutorial.lessons.worker_scripts import worker_script
from ddp_tutorial.lessons import error_line

UNEVEN_JOIN_SCRIPT = worker_script(__file__, "uneven_join.py")
#: Rank code the notebook shows (read with ``lessons.script_source``, never imported in the kernel):
#: the atomic save, and ``Checkpointer``'s save and resume that ``--checkpoint`` runs.
CHECKPOINT_CODE = str(Path(__file__).resolve().parents[2] / "checkpoint.py")


def failure_order(error, world_size: int) -> str:
    """Which rank failed first and what the others did, from a ``world_size``-rank launch's
    ``WorkerError`` (``failed_after``: ranks that failed on their own later)."""
    lines = [f"rank {error.rank} failed first (exit code {error.exit_code}); "
             f"its error: {error_line(error)}"]
    lines += [f"rank {r} failed on its own after it" for r in error.failed_after]
    stopped = [r for r in range(world_size) if r != error.rank and r not in error.failed_after]
    if stopped:
        lines.append(f"rank(s) {', '.join(map(str, stopped))}: stopped by the launcher")
    return "\n".join(lines)
