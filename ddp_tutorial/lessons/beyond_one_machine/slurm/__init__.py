"""The kit's sbatch script, and a small job of it on the local SLURM cluster when one runs.

The cluster itself (start, stop, status) is a maintainer's tool:
``python -m ddp_tutorial.maintainer.slurm``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

#: The kit's sbatch script: one torchrun agent per node, checkpoint and --max-restarts 1.
SBATCH_SCRIPT = str(Path(__file__).resolve().parent / "train.sbatch")


def sbatch_source() -> str:
    """The shipped sbatch script, read from its file (what ``sbatch`` runs)."""
    return Path(SBATCH_SCRIPT).read_text()


def local_job_demo(cluster=None, folder=None, timeout: float = 120.0) -> str:
    """If the local cluster is up: a small 2-node x 2-rank job of train.py, its queue entry and output.

    Otherwise a line that says why not (SLURM missing, or not started) and how to start it.
    Nothing is started here: the cluster is the learner's
    (``python -m ddp_tutorial.maintainer.slurm start``).

    Args:
        cluster: a ``maintainer.slurm.LocalCluster``; default the ``start`` command's folder.
        folder: where the job runs and writes; default a new folder under ``runs/``.
        timeout: seconds the job may take.
    """
    from ddp_tutorial.maintainer.slurm import LocalCluster, missing, wait_for

    why = missing()
    if why:
        return f"No local SLURM cluster here: {why}. The script above is what you would submit on a cluster."
    cluster = cluster or LocalCluster()
    if not cluster.is_up():
        return ("The local SLURM cluster is not running. Start it (as root) with\n"
                "    python -m ddp_tutorial.maintainer.slurm start\n"
                "and run this cell again; stop it afterwards with the same command and `stop`.")
    Path("runs").mkdir(exist_ok=True)
    folder = Path(folder or tempfile.mkdtemp(prefix="08-slurm-", dir="runs")).resolve()
    env = cluster.job_env()
    job = cluster.submit(["--dataset-size", "128", "--batch-size", "8", "--accum-steps", "2", "--epochs", "2",
                          "--out", "run"], cwd=folder, env=env, options=["--output", "job.out"])
    wait_for(lambda: "PENDING" not in cluster.squeue(), timeout, f"job {job} started")
    queue = cluster.squeue()  # while it runs: one job on node[1-2]
    cluster.wait_gone(job, timeout)
    output = (folder / "job.out").read_text() if (folder / "job.out").exists() else "(no output)"
    return f"$ squeue  (while the job runs)\n{queue}\n$ cat job.out  (job {job}, ended)\n{output}"
