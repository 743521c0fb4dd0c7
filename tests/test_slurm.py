"""The shipped sbatch script on a real SLURM cluster started on this machine (nothing mocked).

One controller and two nodes on 127.0.0.1 (``ddp_tutorial.maintainer.slurm``),
started once for the module and stopped by their pids at the end. Each job is
the documented ``sbatch --wait`` command (docs/clusters.md); a job that
outlives its deadline is cancelled and fails the test. Where SLURM cannot run
(not installed, not root), those tests are skipped with the reason (under
CI=true, where .ci/run installs SLURM, they fail instead).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import pid_alive, processes_of_run
from test_beyond_one_machine import assert_same_params, doc_command, set_option

from ddp_tutorial import TRAIN_SCRIPT, launch
from ddp_tutorial.lessons.beyond_one_machine import slurm as lesson
from ddp_tutorial.maintainer import slurm
from ddp_tutorial.runfolder import Run

REPO = Path(__file__).resolve().parents[1]
WHY_NOT = slurm.missing()
# CI installs SLURM (.ci/run): there, a missing cluster is a failure, not a skip that passes vacuously.
IN_CI = os.environ.get("CI") == "true"
needs_slurm = pytest.mark.skipif(WHY_NOT is not None and not IN_CI,
                                 reason=f"no local SLURM cluster: {WHY_NOT}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running local cluster; afterwards every daemon it started is gone."""
    assert WHY_NOT is None, f"CI=true, but {WHY_NOT}"
    local = slurm.LocalCluster(tmp_path_factory.mktemp("slurm"))
    local.start()
    started = local.pids()
    try:
        yield local
    finally:
        local.stop()
    assert not [pid for pid in started.values() if pid_alive(pid)], "a SLURM daemon outlived stop()"


def documented_submit():
    """The documented sbatch command as argv: (sbatch, its options, the script path, train.py's flags)."""
    _env, argv = doc_command("slurm-submit")
    assert argv[0] == "sbatch"
    script = next(i for i, word in enumerate(argv) if word.endswith("train.sbatch"))
    assert (REPO / argv[script]).resolve() == Path(slurm.SBATCH_SCRIPT)
    return argv[1:script], str(REPO / argv[script]), argv[script + 1:]


def job_env(cluster, folder: Path) -> dict:
    """What the submitting shell would hold, and the run folder that processes_of_run looks for."""
    return cluster.job_env(DDP_TUTORIAL_RUN_DIR=str(folder / "runs" / "slurm" / "run"))


def start_job(cluster, folder: Path, extra_flags=(), wait: bool = True):
    """Submit the documented command from ``folder`` (train.py flags ``extra_flags`` added).

    Returns:
        with ``wait``: (job name, the running ``sbatch --wait``); else the job id.
    """
    options, script, flags = documented_submit()
    name = f"ddp-tutorial-test-{uuid.uuid4().hex[:8]}"
    if not wait:
        return cluster.submit([*flags, *extra_flags], folder, job_env(cluster, folder),
                              [f"--job-name={name}", *[o for o in options if o != "--wait"]])
    cmd = [slurm.which("sbatch"), f"--job-name={name}", *options, script, *flags, *extra_flags]
    return name, subprocess.Popen(cmd, cwd=folder, env=job_env(cluster, folder), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)


def finish_job(cluster, folder: Path, name: str, sbatch, timeout: float = 150.0):
    """``sbatch --wait``'s exit status (the job's) and the job's output; past ``timeout`` s, scancel and fail."""
    try:
        sbatch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.run("scancel", f"--name={name}", check=False)
        sbatch.kill()
        sbatch.communicate()
        pytest.fail(f"the job did not end within {timeout:.0f} s; cancelled it.\n{job_output(folder)[-3000:]}"
                    f"\n{cluster.log_tails()}")
    return sbatch.returncode, job_output(folder)


def job_output(folder: Path) -> str:
    """What the job wrote to the documented ``--output`` file (relative to where it was submitted)."""
    options = documented_submit()[0]
    out = folder / options[options.index("--output") + 1]
    return out.read_text() if out.exists() else ""


#: The job that runs to the end: the documented one, with rank 3 (node 2) failing once. Every step
#: but the last runs in its first attempt, on both nodes: one job shows that the script trains as
#: 4 ranks of one launch do and that a failed rank is restarted inside the allocation.
FAIL_ONCE = ["--fail-at-step", "7", "--fail-rank", "3"]


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    """The documented job with ``FAIL_ONCE``, and a 4-rank ``launch`` of the documented training
    while it runs: (exit status, output, run folder), that launch's final model."""
    folder = tmp_path_factory.mktemp("fails-once")
    name, sbatch = start_job(cluster, folder, FAIL_ONCE)
    try:
        flags = documented_submit()[2]
        here = tmp_path_factory.mktemp("four_ranks")
        flags = set_option(set_option(flags, "--checkpoint", here / "ckpt.pt"), "--out", here / "run")
        reference = launch(TRAIN_SCRIPT, 4, flags, run_dir=here / "run", echo="none", timeout=120).model_state()
        done = (*finish_job(cluster, folder, name, sbatch), folder / "runs" / "slurm" / "run")
    finally:  # a failure above leaves no job running
        if sbatch.poll() is None:
            cluster.run("scancel", f"--name={name}", check=False)
            sbatch.kill()
            sbatch.communicate()
    return done, reference


@needs_slurm
def test_the_sbatch_script_on_two_nodes_restarts_a_failed_rank_and_matches_a_four_rank_launch(job):
    (code, output, run_dir), four_ranks = job
    assert code == 0, output[-3000:]
    assert "injected failure (raise) at step 7" in output
    run = Run(run_dir)
    assert run.ranks == [0, 1, 2, 3] and {run.summaries[r]["world_size"] for r in run.ranks} == {4}
    for rank in run.ranks:  # one restart, from the save after step 6, agreed by every rank
        assert [(e["attempt"], e["step"]) for e in run.events[rank] if e["kind"] == "resume"] == [(1, 6)]
    assert_same_params(run.model_state(), four_ranks)
    assert not processes_of_run(run_dir)


@needs_slurm
def test_scancel_leaves_no_rank_behind(cluster, tmp_path):
    # Long enough to be cancelled mid-training: many epochs, each step delayed.
    job = start_job(cluster, tmp_path, ["--epochs", "50", "--straggler-ms", "200"], wait=False)
    run_dir = tmp_path / "runs" / "slurm" / "run"
    deadline = time.monotonic() + 60
    while not all((run_dir / f"rank{r}.jsonl").exists() for r in range(4)):  # every rank is training
        assert time.monotonic() < deadline, f"the job's ranks never started:\n{job_output(tmp_path)}"
        time.sleep(0.2)  # polling the run folder
    assert len(processes_of_run(run_dir)) >= 4
    assert f"{job} " in cluster.squeue() and "RUNNING" in cluster.squeue()
    cluster.run("scancel", job)
    cluster.wait_gone(job, timeout=60)
    assert not processes_of_run(run_dir), "rank processes outlived the cancelled job"


@needs_slurm
def test_a_stopped_cluster_starts_again_clean(cluster):
    # The module's cluster, after its jobs (the last test to use it; its fixture stops it again).
    pids = cluster.pids()
    assert sorted(pids) == ["munged", "slurmctld", "slurmd-node1", "slurmd-node2"]
    assert sorted(cluster.stop()) == sorted(pids)
    assert not [pid for pid in pids.values() if pid_alive(pid)] and not cluster.is_up()
    cluster.start()  # the same folder: nothing left in the way
    assert cluster.idle_nodes() == ["node1", "node2"]
    assert cluster.squeue().splitlines()[1:] == []  # no job carried over


def test_the_guide_shows_the_shipped_script_as_it_is():
    text = (REPO / "docs" / "clusters.md").read_text()
    shown = text.split("<!-- file: ddp_tutorial/lessons/beyond_one_machine/slurm/train.sbatch -->\n", 1)[1]
    assert shown.split("```", 2)[1].split("\n", 1)[1] == Path(slurm.SBATCH_SCRIPT).read_text()


def test_the_demo_says_why_no_job_runs_when_the_cluster_is_down(tmp_path):
    assert lesson.sbatch_source() == Path(slurm.SBATCH_SCRIPT).read_text()
    said = slurm.demo_job(slurm.LocalCluster(tmp_path / "never-started"))
    if WHY_NOT is None:
        assert "not running" in said and "python -m ddp_tutorial.maintainer.slurm start" in said
    else:
        assert WHY_NOT in said


def test_the_nodes_get_two_free_consecutive_ports_even_when_a_neighbour_is_taken(monkeypatch):
    """slurmd's ports are a range: a free port whose neighbour another process listens on is passed over."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        # The first candidate's neighbour is taken, then the controller's port comes up, then a free pair.
        free = slurm.port_can_be_bound
        pair = next(p for p in range(29010, 29200, 2) if free(p) and free(p + 1))
        monkeypatch.setattr(slurm, "candidate_ports", lambda: iter([busy - 1, 29000, pair]))
        assert slurm.node_port_pair(ctld=29001) == pair
        monkeypatch.setattr(slurm, "candidate_ports", lambda: iter([busy - 1]))
        with pytest.raises(slurm.ClusterError, match="no two consecutive free ports"):
            slurm.node_port_pair(ctld=29001)
