"""Beyond one machine: multi-node torchrun, exact resume, atomic saves, restarts, nccl guards.

The distributed tests start real processes (gloo on loopback). Each one names
its own deadline, and every torchrun agent is killed with its process group
in a ``finally``, so a broken rendezvous fails the test instead of hanging it. What notebook 08
asserts itself (a restart under ``launch``, uneven inputs with and without Join) is not repeated.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import processes_of_run

from ddp_tutorial import (TRAIN_SCRIPT, LaunchConfigError, WorkerError, config,
                          free_port, launch, launcher, train)
from ddp_tutorial import checkpoint, envvars
from ddp_tutorial.rank import instrument, restarts
from ddp_tutorial.backend import choose_backend
from ddp_tutorial.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, temp_files
from ddp_tutorial.runfolder import Run

REPO = Path(__file__).resolve().parents[1]
# 2 ranks x 8 micro-batches of 16 per epoch, K=2: 4 optimizer steps per epoch, 16 micro-steps in all.
SMALL = ["--dataset-size", "256", "--batch-size", "16", "--accum-steps", "2", "--epochs", "2"]
# Saves after optimizer steps 3 (micro-step 6: mid-epoch 0), 4 (end of epoch 0), 6 (micro-step 12: mid-epoch 1), 8.
SAVE = ["--save-every", "3"]


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), f"{name} differs"


def assert_same_momentum(a: dict, b: dict) -> None:
    """The SGD momentum buffers of two checkpoints' optimizer states agree."""
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for i in state_a:
        assert torch.allclose(state_a[i]["momentum_buffer"], state_b[i]["momentum_buffer"], atol=1e-6)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 2-rank run that nothing interrupts: (final model state, final checkpoint)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    ckpt = folder / "ckpt.pt"
    run = launch(TRAIN_SCRIPT, 2, SMALL + ["--checkpoint", str(ckpt)], run_dir=folder / "run",
                 echo="none", timeout=120)
    return run.model_state(), load_checkpoint(ckpt)


def doc_command(name: str, doc: Path = REPO / "docs" / "clusters.md"):
    """The shell command in ``doc`` under ``<!-- command: NAME -->``: (its exported env, its argv).

    The tests run the documented commands themselves, so the docs cannot drift from what is proven.
    """
    text = doc.read_text()
    marker = f"<!-- command: {name} -->"
    assert marker in text, f"{doc} has no {marker}"
    block = text.split(marker, 1)[1].split("```", 2)[1]
    env, argv = {}, []
    for line in block.split("\n", 1)[1].replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            env.update(word.split("=", 1) for word in words[1:])
        elif words:
            argv = words
    return env, argv


def set_option(argv, flag: str, value) -> list:
    """``argv`` with ``flag``'s value replaced (the flag must be there)."""
    i = argv.index(flag)
    return argv[:i + 1] + [str(value)] + argv[i + 2:]


def torchrun(nnodes: int, nproc: int, port: int, run_id: str, out: Path, train_args,
             max_restarts: int = 0, shared_store: bool = False):
    """Start one torchrun agent (a "node") running ``-m ddp_tutorial.train --out out`` on loopback.

    The agent's flags and environment are the documented multi-node command's
    (docs/clusters.md), with this test's sizes, port, id and training flags;
    ``shared_store`` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 instead (torchrun's default,
    as in the documented one-node command).
    """
    doc_env, argv = doc_command("two-nodes-restart")
    if shared_store:
        doc_env[envvars.FRESH_RDZV_STORE] = "0"
    agent = argv[1:argv.index("-m")]
    for flag, value in [("--nnodes", nnodes), ("--nproc-per-node", nproc), ("--max-restarts", max_restarts),
                        ("--rdzv-endpoint", f"127.0.0.1:{port}"), ("--rdzv-id", run_id)]:
        agent = set_option(agent, flag, value)
    # --local-addr (in agent): advertise loopback, not the host name, as the address of node 0's workers
    cmd = [sys.executable, "-m", "torch.distributed.run", *agent,
           "-m", "ddp_tutorial.train", "--out", str(out), *train_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **doc_env,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # Inherited by the workers: processes_of_run(out) finds them all, wherever they run.
    env["DDP_TUTORIAL_RUN_DIR"] = str(Path(out).resolve())
    # torchrun's own files (its --log-dir, from the environment: the command stays the documented one)
    # beside the run, not in a new folder of the system's /tmp per agent.
    env["PET_LOG_DIR"] = str(Path(out).resolve().parent / "torchrun-logs")
    # Output to a file, not a pipe: an agent blocked on a full pipe that nobody reads yet would
    # stall the other agent at the rendezvous (wait_agents waits for one agent at a time).
    log = tempfile.TemporaryFile("w+")
    agent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    agent.log = log
    return agent


def wait_agents(agents, out: Path, timeout: float):
    """Each agent's (exit code, output); then kills the agents and every worker they started.

    A run past ``timeout`` (a hang) fails the test with each agent's last output.
    torchrun starts each worker in its own session, so killing the agent's process
    group would miss them; they carry the agents' DDP_TUTORIAL_RUN_DIR instead.
    Asserts that no rank outlived its agent.
    """
    deadline = time.monotonic() + timeout
    hung = False
    try:
        for agent in agents:
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
                break
        left = [] if hung else processes_of_run(out)  # every agent has exited: nothing of the run may be left
    finally:
        for pid in processes_of_run(out):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for agent in agents:
            agent.wait()
    outputs = []
    for agent in agents:
        agent.log.seek(0)
        outputs.append(agent.log.read())
        agent.log.close()
    if hung:
        tails = "\n".join(f"--- agent {i} ---\n{text[-2000:]}" for i, text in enumerate(outputs))
        pytest.fail(f"the agents did not finish within {timeout:.0f} s (a hang); killed them.\n{tails}")
    assert not left, f"rank processes outlived their agents: {left}"
    return [(agent.returncode, output) for agent, output in zip(agents, outputs)]


# -- Multi-node ---------------------------------------------------------------
def test_the_multi_node_commands_shown_are_the_tested_ones():
    """docs/clusters.md's real-cluster command is the tested loopback one but for where the nodes are,
    and notebook 08 shows it as it is there."""
    env, real = doc_command("multi-node")
    tested_env, tested = doc_command("two-nodes-restart")
    assert env == tested_env == {envvars.FRESH_RDZV_STORE: "1"}
    where = {"--nproc-per-node", "--rdzv-endpoint", "--rdzv-id", "--local-addr"}

    def agent_flags(argv):
        agent = argv[1:argv.index("-m")]
        return {f: v for f, v in zip(agent[::2], agent[1::2]) if f not in where}
    assert agent_flags(real) == agent_flags(tested)
    text = (REPO / "docs" / "clusters.md").read_text()
    block = text.split("<!-- command: multi-node -->\n", 1)[1].split("```", 2)[1].split("\n", 1)[1]
    notebook = (REPO / "notebooks" / "08_beyond_one_machine.ipynb").read_text()
    assert all(json_line in notebook for json_line in (json.dumps(line)[1:-1] for line in block.splitlines()))


def test_several_agents_that_may_restart_are_refused_the_shared_store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(RuntimeError, match=f"export {envvars.FRESH_RDZV_STORE}=1"):
        restarts.restart_safe_store(5.0)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restart: the shared store is safe
    assert restarts.restart_safe_store(5.0) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the fresh store per round
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert restarts.restart_safe_store(5.0) is None


# -- Checkpoint and exact resume ------------------------------------------------
def test_run_stopped_mid_epoch_and_resumed_ends_like_an_uninterrupted_run(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt.pt"
    args = SMALL + SAVE + ["--checkpoint", str(ckpt)]
    with pytest.raises(WorkerError):  # rank 0 exits at micro-step 7: the last save was after step 6
        launch(TRAIN_SCRIPT, 2, args + ["--fail-at-step", "7", "--fail-mode", "exit"],
               run_dir=tmp_path / "stopped", echo="none", timeout=120)
    saved = load_checkpoint(ckpt)
    assert (saved["epoch"], saved["micro"], saved["step"], saved["optimizer_steps"]) == (0, 6, 6, 3)

    resumed = launch(TRAIN_SCRIPT, 2, args, run_dir=tmp_path / "resumed", echo="none", timeout=120)
    for rank in resumed.ranks:  # the step numbering continues from the checkpoint
        assert resumed.column(rank, "step") == list(range(6, 16))
    model, final_ckpt = uninterrupted
    assert_same_params(resumed.model_state(), model)
    assert_same_momentum(load_checkpoint(ckpt), final_ckpt)


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1, "blob": [torch.full((256,), 1.0) for _ in range(4)]}, ckpt)
    tmp, code = kill_writer_mid_save(ckpt)
    assert code == -signal.SIGKILL
    with pytest.raises(Exception):  # the unfinished temporary file really is half-written...
        torch.load(tmp, weights_only=True)
    saved = load_checkpoint(ckpt)  # ...but the checkpoint's name still holds the previous save
    assert saved["step"] == 1 and all(torch.equal(t, torch.full((256,), 1.0)) for t in saved["blob"])


def test_a_writer_killed_during_its_first_save_leaves_no_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    tmp, code = kill_writer_mid_save(ckpt)
    assert code == -signal.SIGKILL and tmp.exists()
    assert not ckpt.exists() and load_checkpoint(ckpt) is None


# Saves a large checkpoint (many records, so it takes a while) through save_checkpoint.
WRITER = """
import sys, torch
from ddp_tutorial.checkpoint import save_checkpoint
state = {"step": 2, "blob": [torch.full((512,), 2.0) for _ in range(40000)]}
save_checkpoint(state, sys.argv[1])
print("finished", flush=True)
"""


def kill_writer_mid_save(ckpt: Path, min_bytes: int = 4 << 20, timeout: float = 60.0):
    """SIGKILL a process while its temporary file has ``min_bytes`` but the save is unfinished.

    Returns:
        (the temporary file it left, its exit code).
    """
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(ckpt)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while True:  # poll the file system until the write is well under way
            partial = [p for p in temp_files(ckpt) if p.stat().st_size >= min_bytes]
            if partial:
                writer.kill()
                break
            assert writer.poll() is None, "the writer ended before it could be killed mid-save"
            assert time.monotonic() < deadline, "the writer never started writing its checkpoint"
            time.sleep(0.002)
        out, _ = writer.communicate(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert "finished" not in out
    assert temp_files(ckpt) == partial  # nothing renamed it after the kill
    return partial[0], writer.returncode


# -- Fault-tolerant restarts ----------------------------------------------------
def test_torchrun_max_restarts_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "run"
    args = SMALL + SAVE + ["--checkpoint", str(tmp_path / "ckpt.pt"),
                           "--fail-at-step", "13", "--fail-rank", "1"]
    agent = torchrun(1, 2, free_port(), f"restart-{uuid.uuid4().hex[:8]}", out, args, max_restarts=1,
                     shared_store=True)
    [(code, output)] = wait_agents([agent], out, timeout=150)
    assert code == 0, output[-3000:]
    assert "injected failure (raise) at step 13" in output
    run = Run(out)
    for rank in run.ranks:  # the second attempt resumed at 12, the last save before step 13
        resumes = [(e["attempt"], e["step"], e["epoch"], e["micro"])
                   for e in run.events[rank] if e["kind"] == "resume"]
        assert resumes == [(1, 12, 1, 4)]
        assert [s["step"] for s in run.steps[rank] if s["attempt"] == 1] == list(range(12, 16))
    assert_same_params(run.model_state(), uninterrupted[0])


def documented_restart_args(ckpt: Path, fail_rank: int) -> list:
    """The training flags of the documented two-node restart, with this test's checkpoint and failing rank."""
    _env, argv = doc_command("two-nodes-restart")
    args = argv[argv.index("ddp_tutorial.train") + 1:]
    return set_option(set_option(args, "--checkpoint", ckpt), "--fail-rank", fail_rank)


@pytest.fixture(scope="module")
def four_ranks_uninterrupted(tmp_path_factory):
    """The documented two-node run's training on 4 ranks of one launch, nothing failing: its final model."""
    folder = tmp_path_factory.mktemp("four_ranks")
    args = documented_restart_args(folder / "ckpt.pt", 0)
    args = args[:args.index("--straggler-ms")]  # no delays, no failure: they change no number
    return launch(TRAIN_SCRIPT, 4, args, run_dir=folder / "run", echo="none", timeout=120).model_state()


# The second node's rank 3, or the first node's rank 1, fails at micro-step 7 while the
# other node's ranks are still in their straggler delay: that node's agent sees its workers
# healthy and restarts them only because a node rejoined (no TORCHELASTIC_RESTART_COUNT raise).
@pytest.mark.parametrize("fail_rank", [3, 1], ids=["second-node-fails", "first-node-fails"])
def test_two_nodes_restart_when_one_node_fails_while_the_other_computes(tmp_path, fail_rank,
                                                                       four_ranks_uninterrupted):
    out = tmp_path / "run"
    args = documented_restart_args(tmp_path / "ckpt.pt", fail_rank)
    port, run_id = free_port(), f"restart2-{uuid.uuid4().hex[:8]}"
    agents = [torchrun(2, 2, port, run_id, out, args, max_restarts=1) for _node in range(2)]
    results = wait_agents(agents, out, timeout=180)
    for code, output in results:
        assert code == 0, output[-4000:]
    assert sum("injected failure (raise) at step 7" in output for _, output in results) == 1
    run = Run(out)
    assert run.ranks == [0, 1, 2, 3]  # one group across both agents, not a group per node
    assert {run.summaries[r]["world_size"] for r in run.ranks} == {4}
    for rank in run.ranks:  # every rank agrees that one restart happened, whichever agent counted it
        resumes = [(e["attempt"], e["step"]) for e in run.events[rank] if e["kind"] == "resume"]
        assert resumes == [(1, 6)], (rank, resumes)  # the last save: after step 6, mid-epoch 1
        assert [s["step"] for s in run.steps[rank] if s["attempt"] == 1] == [6, 7]
    assert_same_params(run.model_state(), four_ranks_uninterrupted)


def test_injected_failure_fires_on_the_first_attempt_only():
    args = config.parse(["--fail-at-step", "3", "--fail-rank", "1"], world_size=2)
    fault = instrument.Instrument.from_args(args).fault
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        fault.fire_if_due(rank=1, step=3, attempt=0)
    fault.fire_if_due(rank=1, step=3, attempt=1)  # the restarted group gets past it


def test_resume_refuses_a_checkpoint_of_another_world_size(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    args = config.parse(SMALL + ["--checkpoint", str(ckpt), "--out", str(tmp_path / "run")], world_size=2)
    model = train.Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"world_size": 2, "batch_size": 16, "accum_steps": 2, "dataset_size": 256, "seed": 0}
    counters = {"step": 0, "optimizer_steps": 0}
    save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0,
                     "micro": 4, **counters, **settings}, ckpt)
    hooks = instrument.Instrument.from_args(args)
    # The ranks' check is the kernel's (config.validate's): one message, one error type.
    with pytest.raises(CheckpointError, match=r"checkpoint of another run, made with world_size 2 \(now 4\)"):
        hooks.start(train.DistEnv(rank=0, world_size=4), model, optimizer, 8)
    with pytest.raises(config.ConfigError, match=r"checkpoint of another run, made with world_size 2 \(now 4\)"):
        config.parse(SMALL + ["--checkpoint", str(ckpt)], world_size=4)


def test_resume_refuses_a_model_file_as_a_checkpoint(tmp_path):
    model = train.Model()
    save_checkpoint(model.state_dict(), tmp_path / "model.pt")  # what finish() writes: no position in it
    args = config.parse(SMALL + ["--no-metrics"], world_size=1)
    hooks = instrument.Instrument(checkpointer=checkpoint.Checkpointer(tmp_path / "model.pt", 0, args))
    with pytest.raises(CheckpointError, match="is not a training checkpoint: it has no world_size"):
        hooks.start(train.DistEnv(), model, torch.optim.SGD(model.parameters(), lr=0.1), 8)


def test_save_every_needs_a_checkpoint_path():
    with pytest.raises(config.ConfigError, match="--checkpoint"):
        config.parse(["--save-every", "2"], world_size=2)


# -- nccl guards ---------------------------------------------------------------
def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_fewer_gpus_than_ranks_per_node_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="4 ranks but has 2 GPU"):
        choose_backend("nccl", gpus=2, local_world_size=4)
    fake_gpus(monkeypatch, 2)
    with pytest.raises(LaunchConfigError, match="4 ranks but has 2 GPU"):
        launcher.spec.check_nccl(4)
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("nccl", gpus=0, local_world_size=1)
    fake_gpus(monkeypatch, 0)
    with pytest.raises(LaunchConfigError, match="needs CUDA"):
        launcher.spec.check_nccl(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_launch_refuses_nccl_without_gpus_before_starting_anything(tmp_path):
    with pytest.raises(LaunchConfigError, match="nccl"):
        launch(TRAIN_SCRIPT, 2, SMALL, backend="nccl", run_dir=tmp_path / "run", timeout=30)
    assert not (tmp_path / "run").exists()


def test_every_rank_loads_the_checkpoint_onto_its_own_device(monkeypatch):
    seen = []
    monkeypatch.setattr(checkpoint, "load_checkpoint",
                        lambda path, map_location: seen.append(map_location))  # no file: a fresh start
    args = config.parse(["--checkpoint", "unused.pt", "--no-metrics"], world_size=2)
    env = train.DistEnv(rank=1, world_size=2, local_rank=1, backend="nccl",
                        device=torch.device("cuda", 1))
    assert instrument.Instrument.from_args(args).start(env, None, None, 8) == 0
    assert seen == [torch.device("cuda", 1)]


def test_the_restart_plot_draws_every_step_the_first_attempt_finished_and_the_failure(tmp_path):
    # Run.steps counts a repeated step once (from the later attempt); the plot must not lose step 12.
    import json

    import matplotlib
    matplotlib.use("Agg")
    from ddp_tutorial import Run, plots

    lines = [{"kind": "step", "rank": 1, "attempt": 0, "step": s, "loss": 6.0 - 0.1 * s} for s in range(13)]
    lines += [{"kind": "resume", "rank": 1, "attempt": 1, "step": 12, "epoch": 1, "micro": 4, "optimizer_steps": 6}]
    lines += [{"kind": "step", "rank": 1, "attempt": 1, "step": s, "loss": 6.0 - 0.1 * s} for s in range(12, 16)]
    (tmp_path / "rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = Run(tmp_path)
    assert [s["step"] for s in run.steps[1] if s["attempt"] == 0][-1] == 11  # what the plot once drew
    ax = plots.plot_restart_loss(run, rank=1, failed_at=13)
    drawn = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert drawn["first attempt"] == list(range(13))
    assert drawn["last step the first attempt finished (12)"] == [12]
    assert any(list(line.get_xdata()) == [13, 13] and line.get_color() == "red" for line in ax.get_lines())
