"""The kit's sbatch script, as notebook 08 shows it (a local cluster to run it on:
``python -m ddp_tutorial.maintainer.slurm start|demo|stop``)."""

from __future__ import annotations

from pathlib import Path

#: The kit's sbatch script: one torchrun agent per node, checkpoint and --max-restarts 1.
SBATCH_SCRIPT = str(Path(__file__).resolve().parent / "train.sbatch")


def sbatch_source() -> str:
    """The shipped sbatch script, read from its file (what ``sbatch`` runs)."""
    return Path(SBATCH_SCRIPT).read_text()
