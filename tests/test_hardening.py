"""Hardening: nothing listens beyond loopback, every bad input is refused up front, no record
is lost, no resource leaks, and generated inputs (Hypothesis) keep all of it.

Launches here use tiny scripts from tests/scripts (most import no torch, so one costs a
fraction of a second); the few that train say why they must.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections import Counter
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddp_tutorial
from ddp_tutorial import (TRAIN_SCRIPT, LaunchConfigError, LaunchError, LaunchTimeout, WorkerError,
                          config, launch, launcher, runfolder)
from ddp_tutorial.checkpoint import CheckpointError, save_checkpoint, temp_files
from ddp_tutorial.launcher import procinfo
from ddp_tutorial.launcher.start import launcher_watch
from ddp_tutorial.runfolder import MetricsWriter, Run, counted
from conftest import only_checks, processes_of_run
from test_launcher import wait_for

#: Generated cases run, by outcome (printed at the end of the module).
COUNTS: "Counter[str]" = Counter()

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
PRINT_LINES = str(SCRIPTS / "print_lines.py")
FAIL_FAST = str(SCRIPTS / "fail_fast.py")
TINY = ["--dataset-size", "64", "--batch-size", "4", "--epochs", "1"]


def child_processes() -> list:
    """Pids of live (not zombie) processes started by this test process: its children, and
    the children of its forkserver (warm ranks); multiprocessing's own helpers are not counted."""
    helpers = helper_pids()
    parents = {os.getpid()} | helpers
    return [pid for pid in psutil.pids()
            if pid not in helpers and parent(pid) in parents and procinfo.alive(pid)]


def helper_pids() -> set:
    """The pids of multiprocessing's forkserver and resource tracker (warm launches' helpers)."""
    from multiprocessing import forkserver, resource_tracker

    return {pid for pid in (getattr(forkserver._forkserver, "_forkserver_pid", None),
                            getattr(resource_tracker._resource_tracker, "_pid", None)) if pid}


def parent(pid: int):
    """The parent of ``pid``, None once it is reaped."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def listening_sockets(of) -> list:
    """(address, port, pid) of every listening TCP socket the processes ``of`` hold."""
    found = []
    for pid in of:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:  # exited meanwhile
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN and conn.laddr:
                address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
                found.append((getattr(address, "ipv4_mapped", None) or address, conn.laddr.port, pid))
    return found


# -- 1. Nothing listens beyond loopback --------------------------------------------
@pytest.mark.parametrize("master_port", [None, "fixed"])
def test_while_a_launch_runs_nothing_listens_beyond_loopback(tmp_path, master_port):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    port = launcher.free_port() if master_port else None
    result = {}

    def run():
        try:
            result["run"] = launch(str(SCRIPTS / "hold_process_group.py"), 2, [str(release)],
                                   run_dir=run_dir, timeout=90, echo="none", master_port=port)
        except BaseException as exc:  # handed to the test thread below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # Both ranks joined the process group: the store and gloo's sockets are up.
        wait_for(lambda: "error" in result or (run_dir.is_dir() and all(
            Run(run_dir).results(r) for r in (0, 1))), 90, "both ranks to join")
        assert "error" not in result, result.get("error")
        pids = processes_of_run(run_dir) + [os.getpid()]
        sockets = listening_sockets(pids)
    finally:
        release.touch()
        thread.join(timeout=90)
    assert "error" not in result, result.get("error")
    store_port = Run(run_dir).result(0, "master_port")
    if port:
        assert store_port == port
    # rank 0's store, and a gloo listener per rank, were all found...
    assert store_port in {p for _, p, _ in sockets}
    assert len(sockets) >= 3, sockets
    # ...and every one of them is bound to loopback only.
    exposed = [s for s in sockets if not s[0].is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert result["run"].exit_codes == {0: 0, 1: 0}
    if not port:  # picked outside the ephemeral range, so no outgoing connection takes it meanwhile
        assert store_port in launcher.net.PORTS
    # Free again once the run is over (SO_REUSEADDR, as a new store would bind it).
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", store_port))
        s.listen()


def test_a_group_made_again_after_destroy_joins_with_fresh_keys(runs_root):
    """The store outlives each process group, so each rendezvous gets keys of its own."""
    run = launch(ddp_tutorial.scripts_path("teardown_demo.py"), 2, echo="none", timeout=90)
    for rank in (0, 1):
        assert run.result(rank, "second_init_error")["type"] == "ValueError"
        assert run.result(rank, "reinit_all_reduce") == 3.0


def test_workers_pin_gloo_and_nccl_to_the_loopback_interface(tmp_path):
    lo = launcher.loopback_interface()
    assert lo is not None
    with open(f"/sys/class/net/{lo}/flags") as f:
        assert int(f.read(), 16) & 0x8  # IFF_LOOPBACK
    spec = launcher.LaunchSpec(target=("x.py",), world_size=2, run_dir=tmp_path, backend="gloo")
    env = launcher.start.rank_env(spec, 0, 1234, 0, "fd:7")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["DDP_TUTORIAL_STORE"] == "fd:7"
    assert launcher.start.rank_env(spec, 1, 1234, 0, "join")["DDP_TUTORIAL_STORE"] == "join"
    # what the caller gives wins, as documented
    given = dataclasses.replace(spec, env={"GLOO_SOCKET_IFNAME": "eth9"})
    assert launcher.start.rank_env(given, 1, 1234, 0, "join")["GLOO_SOCKET_IFNAME"] == "eth9"


# -- 2. Every bad input is refused before anything starts ---------------------------
def assert_refused(call, names, runs_root, created=()):
    """``call()`` raises LaunchConfigError naming ``names``, only checking (``only_checks``), starting nothing."""
    with only_checks(), pytest.raises(LaunchConfigError) as info:
        call()
    for name in names:
        assert name in str(info.value), str(info.value)
    assert not child_processes()
    assert not runs_root.exists() or not any(runs_root.iterdir())
    for path in created:
        assert not Path(path).exists()
    return info.value


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, names", [
    ({"timeout": NAN}, ["timeout", "finite"]), ({"timeout": INF}, ["timeout"]),
    ({"timeout": -1}, ["timeout"]), ({"timeout": 0}, ["timeout", "> 0"]),
    ({"timeout": "10"}, ["timeout"]), ({"timeout": None}, ["timeout"]), ({"timeout": True}, ["timeout"]),
    ({"grace": None}, ["grace", ">= 0"]), ({"grace": NAN}, ["grace"]), ({"grace": -0.5}, ["grace"]),
    ({"grace": "1"}, ["grace"]),
    ({"max_restarts": "1"}, ["max_restarts", "integer >= 0"]), ({"max_restarts": -1}, ["max_restarts"]),
    ({"max_restarts": 1.0}, ["max_restarts"]), ({"max_restarts": None}, ["max_restarts"]),
    ({"world_size": 2.0}, ["world_size", "integer >= 1"]), ({"world_size": "2"}, ["world_size"]),
    ({"world_size": True}, ["world_size"]), ({"world_size": 1025}, ["world_size", "<= 1024"]),
    ({"world_size": 0}, ["world_size must be an integer >= 1"]), ({"world_size": -2}, ["world_size"]),
    ({"master_port": 0}, ["master_port", "<= 65535"]), ({"master_port": 65536}, ["master_port"]),
    ({"master_port": "29500"}, ["master_port"]), ({"master_port": -1}, ["master_port"]),
    ({"backend": None}, ["backend"]), ({"backend": ["gloo"]}, ["backend"]), ({"backend": "GLOO"}, ["backend"]),
    ({"backend": "mpi"}, ["backend must be"]),
    ({"echo": None}, ["echo"]), ({"echo": "rank1"}, ["echo"]),
    ({"args": "--epochs 2"}, ["args", "list of arguments"]), ({"args": b"--epochs"}, ["args"]),
    ({"args": 5}, ["args"]), ({"args": None}, ["args"]), ({"args": [None]}, ["args[0]"]),
    ({"args": ["--epochs", True]}, ["args[1]"]), ({"args": ["a\0b"]}, ["args[0]", "NUL"]),
    ({"args": [{"a": 1}]}, ["args[0]"]),
    ({"env": {"X": 1}}, ["env['X']", "string"]), ({"env": {"": "1"}}, ["env key"]),
    ({"env": {"A=B": "1"}}, ["env key"]), ({"env": {1: "x"}}, ["env key"]), ({"env": "X=1"}, ["env"]),
    ({"env": {"X": "a\0"}}, ["env['X']", "NUL"]), ({"env": [("X", "1")]}, ["env"]),
    ({"script": 42}, ["script"]), ({"script": None}, ["script"]), ({"script": ""}, ["script"]),
    ({"script": str(HERE)}, ["script", "is a folder"]), ({"script": "no/such.py"}, ["script not found"]),
    ({"script": "-m not valid!"}, ["does not name a module"]),
    ({"script": "-m ddp_tutorial.no_such"}, ["not found"]),
    ({"run_dir": ""}, ["run_dir"]), ({"run_dir": 3}, ["run_dir"]),
])
def test_bad_launch_parameters_are_refused_naming_the_parameter(runs_root, kwargs, names):
    call = {"script": PRINT_LINES, "world_size": 2, **kwargs}
    assert_refused(lambda: launch(**call), names, runs_root)


def test_bad_run_dirs_are_refused(runs_root, tmp_path, monkeypatch):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.txt").write_text("x")
    for run_dir, needle in ((a_file, "is a file"), (a_file / "sub", "cannot be made"),
                            (full, "not empty")):
        assert_refused(lambda: launch(PRINT_LINES, 1, run_dir=run_dir), ["run_dir", needle], runs_root)
    assert a_file.read_text() == "x" and sorted(p.name for p in full.iterdir()) == ["old.txt"]
    # DDP_TUTORIAL_RUNS naming a file: the default run folder cannot be made either
    monkeypatch.setenv("DDP_TUTORIAL_RUNS", str(a_file))
    assert_refused(lambda: launch(PRINT_LINES, 1), ["DDP_TUTORIAL_RUNS", "is a file"], runs_root)


@pytest.mark.parametrize("flags, names", [
    (["--lr", "nan"], ["--lr", "finite"]), (["--lr", "inf"], ["--lr"]), (["--lr", "0"], ["--lr", "> 0"]),
    (["--momentum", "nan"], ["--momentum"]), (["--momentum", "1.5"], ["--momentum", "<= 0.999"]),
    (["--momentum", "-0.1"], ["--momentum"]),
    (["--straggler-ms", "nan"], ["--straggler-ms", "finite"]), (["--straggler-ms", "-1"], ["--straggler-ms"]),
    (["--straggler-ms", "inf"], ["--straggler-ms"]), (["--straggler-ms", "1e9"], ["--straggler-ms"]),
    (["--bucket-cap-mb", "nan"], ["--bucket-cap-mb"]), (["--bucket-cap-mb", "0"], ["--bucket-cap-mb"]),
    (["--pg-timeout", "nan"], ["--pg-timeout"]), (["--pg-timeout", "0"], ["--pg-timeout"]),
    (["--pg-timeout", "-inf"], ["--pg-timeout"]),
    (["--threads", "-1"], ["--threads"]), (["--threads", "100000"], ["--threads"]),
    (["--seed", "-1"], ["--seed"]), (["--seed", str(2 ** 40)], ["--seed"]),
    (["--epochs", "0"], ["--epochs"]), (["--epochs", "1.5"], ["--epochs", "invalid int"]),
    (["--batch-size", "x"], ["--batch-size"]), (["--accum-steps", "-3"], ["--accum-steps"]),
    (["--batch-size", "0"], ["--batch-size must be at least 1"]), (["--accum-steps", "0"], ["--accum-steps must be at least 1"]),
    (["--dataset-size", "10", "--batch-size", "8"], ["smaller than world_size x batch size"]),
    (["--epochs", "zero"], ["bad training flags"]),
    (["--save-every", "-1", "--checkpoint", "c.pt"], ["--save-every"]),
    (["--fail-at-step", "-2"], ["--fail-at-step"]), (["--fail-rank", "5"], ["--fail-rank"]),
    (["--fail-rank", "-1"], ["--fail-rank"]), (["--fail-mode", "explode"], ["--fail-mode"]),
    (["--backend", "mpi"], ["--backend"]), (["--bug", "nope"], ["--bug"]),
    (["--no-such-flag"], ["unrecognized arguments"]), (["--help"], ["bad training flags"]),
    (["--out", ""], ["--out"]),
])
def test_bad_training_flags_are_refused_naming_the_flag(runs_root, flags, names):
    assert_refused(lambda: launch(TRAIN_SCRIPT, 2, flags), names, runs_root)
    with pytest.raises(config.ConfigError):
        config.parse(flags, 2)


def test_path_flags_are_refused_when_of_the_wrong_kind(runs_root, tmp_path):
    a_file, a_dir = tmp_path / "file.txt", tmp_path / "dir"
    a_file.write_text("x")
    a_dir.mkdir()
    cases = [(["--out", str(a_file)], ["--out", "is a file"]),
             (["--out", str(a_file / "sub")], ["--out", "cannot be made"]),
             (["--checkpoint", str(a_dir)], ["--checkpoint", "is a folder"]),
             (["--checkpoint", str(a_file / "c.pt")], ["--checkpoint", "cannot be made"]),
             (["--checkpoint", str(a_file)], ["--checkpoint", "is not a checkpoint"])]
    for flags, names in cases:
        assert_refused(lambda: launch(TRAIN_SCRIPT, 2, flags), names, runs_root)


def small_checkpoint(path: Path, world_size: int = 2) -> Path:
    """A checkpoint as train.py writes it at ``path``, made with TINY's settings and ``world_size``."""
    model = torch.nn.Linear(10, 20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    args = config.parse(TINY, world_size)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0, "micro": 2,
             "step": 2, "optimizer_steps": 1, "world_size": world_size, "batch_size": args.batch_size,
             "accum_steps": args.accum_steps, "dataset_size": args.dataset_size, "seed": args.seed}
    return save_checkpoint(state, path)


def test_a_file_that_is_not_a_checkpoint_or_of_another_run_is_refused(runs_root, tmp_path):
    model_pt = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(10, 20).state_dict(), model_pt)
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    other = small_checkpoint(tmp_path / "other.pt", world_size=4)
    ours = small_checkpoint(tmp_path / "ours.pt", world_size=2)
    for path, needle in ((model_pt, "not a training checkpoint"), (text, "is not a checkpoint"),
                         (other, "checkpoint of another run, made with world_size 4 (now 2)")):
        assert_refused(lambda: launch(TRAIN_SCRIPT, 2, TINY + ["--checkpoint", str(path)]),
                       ["--checkpoint", needle], runs_root)
    assert_refused(lambda: launch(TRAIN_SCRIPT, 2, TINY + ["--checkpoint", str(ours), "--seed", "9"]),
                   ["another run", "seed 0 (now 9)"], runs_root)
    config.parse(TINY + ["--checkpoint", str(ours)], 2)  # the same settings: accepted
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        ddp_tutorial.checkpoint.load_checkpoint(text)


def test_train_py_itself_refuses_a_non_checkpoint(tmp_path):
    """Under torchrun or as a plain process, train.py checks its flags the same way."""
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "ddp_tutorial.train", "--out", str(tmp_path / "out"),
                           "--checkpoint", str(text), *TINY], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and "is not a checkpoint" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_out_and_backend_are_read_from_the_parsed_flags(runs_root, tmp_path):
    # --backend=nccl in '=' form, abbreviated: read as nccl, refused here for want of GPUs
    if not torch.cuda.is_available():
        assert_refused(lambda: launch(TRAIN_SCRIPT, 2, ["--back=nccl"]), ["nccl", "CUDA"], runs_root)
    assert_refused(lambda: launch(TRAIN_SCRIPT, 2, ["--backend=nccl"], backend="gloo"),
                   ["backend='gloo'", "--backend nccl", "disagree"], runs_root)
    assert_refused(lambda: launch(TRAIN_SCRIPT, 2, ["--out=" + str(tmp_path / "a")],
                                  run_dir=tmp_path / "b"), ["run_dir", "--out", "different"],
                   runs_root, created=[tmp_path / "a", tmp_path / "b"])
    out = tmp_path / "trained"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert_refused(lambda: launch(TRAIN_SCRIPT, 1, ["--ou", str(tmp_path / "full")]),
                   ["--out", "not empty"], runs_root)
    # One real run: `--ou=DIR` (abbreviated, '=' form) trains into DIR and Run reads DIR.
    run = launch(TRAIN_SCRIPT, 1, TINY + ["--ou=" + str(out)], echo="none", timeout=120)
    assert run.run_dir == out.resolve() and len(run.steps[0]) == 16 and run.summaries[0]
    assert not runs_root.exists() or not any(runs_root.iterdir())  # nothing went anywhere else


def test_cli_refuses_bad_input_and_runs_without_metrics(tmp_path):
    env = {**os.environ, "DDP_TUTORIAL_RUNS": str(tmp_path / "runs")}
    bad = subprocess.run([sys.executable, "-m", "ddp_tutorial", "--timeout", "nan"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 1 and "timeout must be a finite number" in bad.stderr
    assert not (tmp_path / "runs").exists()
    ok = subprocess.run([sys.executable, "-m", "ddp_tutorial", "--world-size", "1", "--epochs", "1",
                         "--dataset-size", "64", "--no-metrics", "--echo", "none",
                         "--out", str(tmp_path / "run")], capture_output=True, text=True,
                        timeout=180, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "--no-metrics: no metrics or figures" in ok.stdout
    assert (tmp_path / "run" / "model.pt").is_file() and not list((tmp_path / "run").glob("rank*.jsonl"))


def test_two_launches_cannot_take_the_same_run_dir(tmp_path):
    """Claims race from two threads on 30 fresh folders: exactly one wins each."""
    for i in range(30):
        folder, outcomes, start = tmp_path / f"run{i}", [], threading.Barrier(2)

        def claim():
            start.wait()
            try:
                runfolder.claim(folder, "print_lines", "run_dir", {})
                outcomes.append("won")
            except runfolder.RunFolderError as exc:
                outcomes.append(str(exc))

        threads = [threading.Thread(target=claim) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes)[-1] == "won" and outcomes.count("won") == 1, outcomes
        assert any("taken by another launch" in o or "not empty" in o for o in outcomes)


# -- 3. No record lost -------------------------------------------------------------
def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"kind": "step", "step": 0, "attempt": 0}\n{"kind": "step", "ste')  # died mid-write
    writer = MetricsWriter(str(tmp_path), 0, fresh=False, attempt=1)
    writer.write({"kind": "step", "step": 1})
    writer.close()
    run = Run(tmp_path, attempt=1)
    assert [(s["step"], s["attempt"]) for s in run.steps[0]] == [(1, 1)]
    assert path.read_text().count("\n") == 3
    # an append to a file that ended cleanly adds no blank line
    MetricsWriter(str(tmp_path), 0, fresh=False, attempt=2).close()
    assert path.read_text().endswith('"attempt": 1}\n')


def steps(attempt, first, last):
    return [{"kind": "step", "attempt": attempt, "step": s, "optimizer_step": s % 2 == 1,
             "sync": s % 2 == 1, "loss": float(s), "allreduce_calls": s % 2} for s in range(first, last)]


def test_counted_steps_take_each_step_once_from_the_latest_attempt():
    resumed = steps(0, 0, 13) + steps(1, 12, 16)  # attempt 1 resumed from a checkpoint at step 12
    assert [(r["attempt"], r["step"]) for r in counted(resumed, 1)] == (
        [(0, s) for s in range(12)] + [(1, s) for s in range(12, 16)])
    scratch = steps(0, 0, 5) + steps(1, 0, 8)  # attempt 1 started over
    assert [(r["attempt"], r["step"]) for r in counted(scratch, 1)] == [(1, s) for s in range(8)]
    chain = steps(0, 0, 8) + steps(1, 6, 15) + steps(2, 12, 16)
    assert [r["step"] for r in counted(chain, 2)] == list(range(16))
    assert [r["attempt"] for r in counted(chain, 2)] == [0] * 6 + [1] * 6 + [2] * 4
    assert counted(steps(0, 0, 5), 1) == []  # attempt 1 has not stepped yet


def test_run_reports_the_final_attempt_and_each_attempt_on_request(tmp_path):
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.jsonl", "w") as f:
            for rec in (steps(0, 0, 13) + [{"kind": "resume", "attempt": 1, "step": 12}] + steps(1, 12, 16)
                        + [{"kind": "summary", "attempt": 1, "optimizer_steps": 8, "micro_steps": 16}]):
                f.write(json.dumps(rec) + "\n")
    run = Run(tmp_path)
    assert run.attempts == [0, 1] and run.attempt == 1
    assert run.column(0, "step") == list(range(16))  # step 12 once, not twice
    assert run.optimizer_steps(0) == run.summaries[0]["optimizer_steps"] == 8
    assert run.allreduce_calls(1) == 8 and len(run.mean_loss_curve()) == 16
    assert [e["kind"] for e in run.events[0]] == ["resume"]
    first = Run(tmp_path, attempt=0)
    assert first.column(0, "step") == list(range(13)) and not first.summaries and not first.events[0]
    assert Run(tmp_path, attempt=1).column(1, "step") == list(range(12, 16))
    assert len(run.records[0]) == 13 + 1 + 4 + 1  # everything is still there


def test_a_restarted_launch_loses_no_record_and_counts_each_step_once(tmp_path):
    """Attempt 0 tears its last line and fails; attempt 1 resumes at step 2 and appends."""
    run = launch(str(SCRIPTS / "restart_records.py"), 2, run_dir=tmp_path / "run", echo="none",
                 max_restarts=1, timeout=60)
    for rank in (0, 1):
        assert [(s["attempt"], s["step"]) for s in run.steps[rank]] == (
            [(0, 0), (0, 1), (1, 2), (1, 3), (1, 4), (1, 5)])
        assert [s["step"] for s in Run(run.run_dir, attempt=0).steps[rank]] == [0, 1, 2, 3]
        assert run.result(rank, "attempt") == 1 and run.summaries[rank]["attempt"] == 1


def test_a_save_keeps_other_writers_temporary_files(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    other = tmp_path / f".{ckpt.name}.99999999.other.tmp"  # another writer, mid-save
    other.write_bytes(b"partial")
    save_checkpoint({"step": 1}, ckpt)
    assert other.read_bytes() == b"partial" and temp_files(ckpt) == [other]
    with pytest.raises(Exception):
        save_checkpoint({"fn": lambda: 0}, ckpt)  # cannot be pickled: this save fails...
    assert temp_files(ckpt) == [other]  # ...and removes only its own temporary file
    assert ddp_tutorial.checkpoint.load_checkpoint(ckpt) == {"step": 1}


def test_concurrent_saves_use_their_own_temporary_files(tmp_path, monkeypatch):
    ckpt, seen = tmp_path / "ckpt.pt", []
    real_replace = os.replace

    def record(src, dst):
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(ddp_tutorial.checkpoint.os, "replace", record)
    threads = [threading.Thread(target=save_checkpoint, args=({"i": i}, ckpt)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 8 and all(f".{os.getpid()}." in n for n in seen)
    assert ddp_tutorial.checkpoint.load_checkpoint(ckpt)["i"] in range(8) and temp_files(ckpt) == []


# -- 4. No resource leaked ----------------------------------------------------------
def open_fds() -> int:
    return psutil.Process().num_fds()


def os_threads() -> int:
    return psutil.Process().num_threads()


def test_many_launches_with_kept_failures_leave_fds_and_threads_flat(runs_root):
    kept = []

    def one_pair():
        launch(PRINT_LINES, 2, echo="none", timeout=60)
        with pytest.raises(WorkerError) as info:
            launch(FAIL_FAST, 2, echo="none", timeout=60)
        kept.append(info.value)  # a notebook that keeps its errors

    one_pair()  # warm-up: first-use imports and caches
    before = (open_fds(), threading.active_count(), os_threads())
    for _ in range(20):
        one_pair()
    after = (open_fds(), threading.active_count(), os_threads())
    assert after == before, f"(fds, Python threads, OS threads): {before} -> {after}"
    assert len(kept) == 21 and all(e.rank == 0 and "planned failure" in e.traceback for e in kept)
    assert not child_processes()


@pytest.mark.parametrize("warm_start", [False, True], ids=["cold", "warm"])
def test_signals_go_only_to_ranks_of_this_launch(monkeypatch, warm_start):
    """Cold ranks are our children, signalled only before we reap them (their pid is still theirs).
    Warm ranks are the forkserver's children, which it reaps at once: a group is signalled only for a rank
    of this launch. A deadline makes sure there are live ranks to stop."""
    sent = []
    real_killpg = os.killpg

    def checked_killpg(pgid, sig):
        sent.append((pgid, sig, parent(pgid)))  # None if reaped already
        real_killpg(pgid, sig)

    monkeypatch.setattr(launcher.procgroup.os, "killpg", checked_killpg)
    with pytest.raises(WorkerError) as info:
        launch(FAIL_FAST, 3, echo="none", timeout=60, warm=warm_start)
    with pytest.raises(LaunchTimeout) as hung:  # both ranks alive at the deadline: each group gets SIGTERM
        launch(str(SCRIPTS / "sleep_forever.py"), 2, echo="none", timeout=8, warm=warm_start)
    assert info.value.run.start_mode == hung.value.run.start_mode == ("warm" if warm_start else "cold")
    stopped = {pgid for pgid, sig, _ in sent if sig == signal.SIGTERM}
    assert set(hung.value.run.pids) <= stopped, (sent, hung.value.run.pids)
    for pgid, _, ppid in sent:
        assert pgid in info.value.run.pids + hung.value.run.pids  # a rank of these launches: its pid is its group
        if not warm_start:
            assert ppid == os.getpid()  # ...and not yet reaped: the pid is still the rank's
    if warm_start:
        servers = helper_pids()
        assert servers and all(parent(s) == os.getpid() for s in servers)  # the forkserver is our child
        return
    count = len(sent)
    group = launcher.start.WorkerGroup([sys.executable, "-c", "pass"], [dict(os.environ)], "none", None,
                                             launcher_watch())
    assert group.wait(time.monotonic() + 30)
    group.stop()  # every rank reaped: nothing left to signal
    group.close()
    assert len(sent) == count + 1  # only the sweep at its exit, while it was a zombie


def test_waits_end_at_their_deadlines_even_for_a_rank_that_never_dies(monkeypatch):
    """A rank the kernel cannot reap (stuck in uninterruptible I/O), played by hiding its exit."""
    group = launcher.start.WorkerGroup([sys.executable, "-c", "import time; time.sleep(60)"],
                                             [dict(os.environ)], "none", None, launcher_watch())
    try:
        monkeypatch.setattr(launcher.procgroup, "has_exited", lambda p: False)
        monkeypatch.setattr(launcher.procgroup, "KILL_WAIT_S", 0.5)
        t0 = time.monotonic()
        group.stop(grace=0.2)  # SIGTERM, 0.2 s, SIGKILL, 0.5 s: then it gives up
        assert time.monotonic() - t0 < 5 and group.exit_codes == {0: None}
    finally:
        monkeypatch.undo()
        group.stop(grace=0)
        group.close()
    assert group.exit_codes[0] == -signal.SIGTERM  # it died at the first signal: only its exit was hidden


def test_output_held_open_by_an_escaped_grandchild_is_not_waited_for_forever(runs_root):
    fds = open_fds()
    t0 = time.monotonic()
    run = launch(str(SCRIPTS / "escaped_child.py"), 1, echo="none", timeout=60)
    elapsed = time.monotonic() - t0
    child = int(run.output[0][0].split()[1])
    try:
        assert run.exit_codes == {0: 0}
        assert elapsed < launcher.start.DRAIN_S + 10  # the drain gave up after DRAIN_S
    finally:
        os.kill(child, signal.SIGKILL)
    assert open_fds() == fds  # the pipe's read end is closed all the same


def test_free_port_stays_below_every_default_ephemeral_range_and_varies():
    ports = [launcher.free_port() for _ in range(20)]
    # Linux's default ephemeral range starts at 32768; macOS's, Windows' and IANA's at 49152.
    assert all(20000 <= p < 32768 for p in ports), ports
    assert len(set(ports)) > 15


def test_free_port_lets_the_os_pick_when_every_candidate_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(launcher.net, "candidate_ports", lambda: iter([busy, busy]))
        port = launcher.free_port()
        assert port != busy and 1 <= port <= 65535


# -- 5. Generated inputs --------------------------------------------------------------
class Sentinel(Exception):
    """Raised instead of starting workers, where a test only checks what happens before."""


def everything_or_nothing(call, runs_root, deadline_s):
    """Run ``call``: it returns a Run or raises a LaunchError subclass, within ``deadline_s``,
    leaving no process behind and at most the one run folder it reports."""
    before = set(runs_root.iterdir()) if runs_root.exists() else set()
    t0 = time.monotonic()
    try:
        result = call()
    except LaunchError as exc:
        result = exc
    elapsed = time.monotonic() - t0
    assert elapsed < deadline_s, f"{elapsed:.1f} s"
    assert not child_processes()
    after = set(runs_root.iterdir()) if runs_root.exists() else set()
    run = result if isinstance(result, Run) else getattr(result, "run", None)
    if isinstance(result, LaunchConfigError):
        assert after == before  # refused: no folder
    elif run is not None:
        assert not processes_of_run(run.run_dir)
        assert after - before <= {run.run_dir}
    return result


FREE_PORT = object()  # stands for a port free at the time of the call
#: Values of the wrong type for every parameter (None and lists are added where they are wrong).
JUNK = st.one_of(st.booleans(), st.text(max_size=5), st.binary(max_size=3), st.floats(allow_nan=True))
ANY_JUNK = st.one_of(st.none(), st.lists(st.integers(), max_size=2), JUNK)
#: Per parameter of launch(): (valid values, invalid values).
PARAMS = {
    "script": (st.sampled_from([PRINT_LINES, FAIL_FAST]),
               st.one_of(st.sampled_from([str(HERE), "missing.py", "", "-m ddp_tutorial.nope", "-m bad name",
                                          PRINT_LINES + "\0"]), st.none(), JUNK.filter(lambda v: v != ""))),
    "world_size": (st.integers(1, 3), st.one_of(st.integers(-3, 0), st.just(launcher.MAX_WORLD_SIZE + 1), ANY_JUNK)),
    "args": (st.lists(st.one_of(st.text(max_size=6).filter(lambda t: "\0" not in t), st.integers(),
                                st.floats()), max_size=3),
             st.one_of(st.text(max_size=8), st.lists(st.one_of(st.none(), st.booleans(), st.just("a\0")),
                                                     min_size=1, max_size=2),
                       st.none(), JUNK)),
    # a third of the valid timeouts expire: LaunchTimeout, the ranks stopped
    "timeout": (st.one_of(st.floats(5, 20), st.floats(5, 20), st.floats(0.001, 1)),
                st.one_of(st.sampled_from([NAN, INF, -INF, -1.0, 0, 0.0]), st.integers(-3, 0),
                          st.none(), JUNK.filter(lambda v: not isinstance(v, float) or not math.isfinite(v) or v <= 0))),
    "grace": (st.floats(min_value=0, max_value=2),
              st.one_of(st.sampled_from([NAN, INF, -1.0]),
                        st.none(), JUNK.filter(lambda v: not isinstance(v, float) or not math.isfinite(v) or v < 0))),
    "max_restarts": (st.integers(0, 1), st.one_of(st.integers(-3, -1), ANY_JUNK)),
    "master_port": (st.sampled_from([None, FREE_PORT]),
                    st.one_of(st.sampled_from([0, -5, 65536, 70000]), JUNK)),
    "backend": (st.sampled_from(["auto", "gloo"]), st.one_of(st.sampled_from(["mpi", "", "Gloo"]), ANY_JUNK)),
    "echo": (st.sampled_from(["none", "rank0"]), st.one_of(st.sampled_from(["loud", ""]), ANY_JUNK)),
    "env": (st.one_of(st.none(), st.dictionaries(st.sampled_from(["HYP_A", "HYP_B"]),
                                                 st.text(max_size=4).filter(lambda t: "\0" not in t),
                                                 max_size=2)),
            st.one_of(st.dictionaries(st.sampled_from(["", "A=B", "HYP_\0"]), st.text(max_size=2),
                                      min_size=1, max_size=1),
                      st.dictionaries(st.just("HYP_C"), st.one_of(st.integers(), st.none()), min_size=1),
                      st.lists(st.integers(), max_size=2), JUNK)),
    "run_dir": (st.sampled_from([None, "new"]), st.sampled_from(["file", "full", "under_file", ""])),
}


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), broken=st.sampled_from([None, None, None] + sorted(PARAMS)))
def test_generated_launch_arguments_succeed_or_fail_cleanly(runs_root, tmp_path, data, broken):
    """All parameters valid but at most one (``broken``): launch succeeds or fails cleanly."""
    values = {name: data.draw(invalid if name == broken else valid, label=name)
              for name, (valid, invalid) in PARAMS.items()}
    folders = {"new": tmp_path / f"new{time.monotonic_ns()}", "file": tmp_path / "a_file",
               "full": tmp_path / "full", "under_file": tmp_path / "a_file" / "sub", "": ""}
    folders["file"].write_text("x")
    folders["full"].mkdir(exist_ok=True)
    (folders["full"] / "x").write_text("x")
    values["run_dir"] = folders.get(values["run_dir"])
    if values["master_port"] is FREE_PORT:  # a valid fixed port that nothing holds
        values["master_port"] = launcher.free_port()
    script, world_size = values.pop("script"), values.pop("world_size")
    finite = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa
    budget = 10 + sum(max(0, values[k]) for k in ("timeout", "grace") if finite(values[k])) * 2
    result = everything_or_nothing(lambda: launch(script, world_size, **values), runs_root, budget)
    COUNTS["launch " + type(result).__name__] += 1
    if broken is not None:
        assert isinstance(result, LaunchConfigError), broken
        assert broken in str(result) or broken == "script", str(result)
    else:
        assert not isinstance(result, LaunchConfigError), result
    if isinstance(result, LaunchConfigError) and values["run_dir"] == folders["new"]:
        assert not folders["new"].exists()
    if isinstance(result, Run):
        assert script == PRINT_LINES and result.exit_codes == {r: 0 for r in range(world_size)}
    if isinstance(result, WorkerError):
        assert script == FAIL_FAST and result.rank == 0


FLAG_VALUES = st.one_of(st.integers(-3, 5000), st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from(["nan", "inf", "-inf", "1e400", "", "x", "0", "0.5", "gloo", "auto",
                                         "raise", "hang", "loss-not-scaled", "all"]))
FLAGS = ["--epochs", "--batch-size", "--accum-steps", "--dataset-size", "--lr", "--momentum", "--seed",
         "--straggler-ms", "--bucket-cap-mb", "--threads", "--pg-timeout", "--save-every",
         "--fail-at-step", "--fail-rank", "--backend", "--fail-mode", "--bug", "--out"]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES,
                                st.sampled_from([" ", "="])), max_size=4),
       world_size=st.integers(1, 4))
def test_generated_training_flags_are_refused_or_checked(runs_root, monkeypatch, pairs, world_size):
    """Through launch() and the CLI; valid flags reach the start of the workers (stubbed here)."""
    argv = []
    for flag, value, form in pairs:
        value = "" if flag == "--out" and value != "" else value  # never write into the repository
        argv += [f"{flag}={value}"] if form == "=" else [flag, str(value)]

    def no_start(*a, **k):
        raise Sentinel()

    monkeypatch.setattr(launcher.start, "start_attempt", no_start)
    folders = lambda: set(runs_root.iterdir()) if runs_root.exists() else set()  # noqa: E731
    before = folders()
    try:
        parsed = config.parse(argv, world_size)
    except config.ConfigError:
        parsed = None
    if parsed is not None:  # whatever passes is a sane run
        for value in (parsed.lr, parsed.momentum, parsed.straggler_ms, parsed.pg_timeout):
            assert math.isfinite(value)
        assert parsed.bucket_cap_mb is None or math.isfinite(parsed.bucket_cap_mb)
        assert parsed.lr > 0 and parsed.epochs >= 1 and 0 <= parsed.fail_rank < world_size
    with only_checks():
        try:
            launch(TRAIN_SCRIPT, world_size, argv, echo="none")
            pytest.fail("the stub starts nothing, so launch cannot return")
        except LaunchConfigError:
            assert parsed is None and folders() == before
            COUNTS["flags refused"] += 1
        except Sentinel:
            assert parsed is not None and len(folders() - before) == 1  # its run folder, then the stub
            COUNTS["flags accepted"] += 1
    assert not child_processes()
    from ddp_tutorial import __main__ as cli

    try:
        code = cli.main(["--world-size", str(world_size), *argv])
        assert code == 1  # a LaunchConfigError, printed
    except SystemExit as exc:  # argparse's own refusal: usage and exit 2
        assert exc.code == 2
    except Sentinel:
        pass


@pytest.fixture(autouse=True, scope="module")
def report_counts():
    """Print how many generated cases ran, by outcome (pytest -s shows it)."""
    yield
    if COUNTS:
        print(f"\ngenerated cases: {dict(COUNTS)}")
