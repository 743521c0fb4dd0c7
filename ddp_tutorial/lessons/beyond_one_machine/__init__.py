"""Lesson 08 (beyond one machine): its worker scripts are in ``workers/``.

Notebook 08 mostly launches train.py itself (multi-node torchrun, checkpoints,
restarts); ``workers/uneven_join.py`` shows uneven inputs with and without
``Join``, and ``workers/gpu_check.sh`` checks the nccl path on a GPU machine.
``slurm/`` holds the sbatch script and a local SLURM cluster to run it on.
"""

from pathlib import Path

from ddp_tutorial.launcher import worker_script

UNEVEN_JOIN_SCRIPT = worker_script(__file__, "uneven_join.py")
#: Rank code the notebook shows (read with ``lessons.script_source``, never imported in the kernel):
#: the atomic save, and ``Checkpointer``'s save and resume that ``--checkpoint`` runs.
CHECKPOINT_CODE = str(Path(__file__).resolve().parents[2] / "rank" / "checkpoint.py")
