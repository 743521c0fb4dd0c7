"""The launcher's fault contract: fail fast, deadlines, interrupts, no orphans, clear errors."""

import _thread
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ddp_tutorial
from ddp_tutorial import LaunchConfigError, LaunchError, LaunchTimeout, WorkerError, launch, launcher
from ddp_tutorial.launcher import warm_ready
from conftest import cmdline, pid_alive, processes_of_run

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
TINY = ["--dataset-size", "64", "--batch-size", "4", "--epochs", "1"]


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_error_classes_share_launch_error():
    for cls in (LaunchConfigError, WorkerError, LaunchTimeout):
        assert issubclass(cls, LaunchError)
    assert issubclass(LaunchConfigError, ValueError)
    assert issubclass(LaunchTimeout, TimeoutError)


def test_output_is_prefixed_per_rank_and_kept(capsys):
    run = launch(str(SCRIPTS / "print_lines.py"), 2)
    printed = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        assert run.output[rank] == [f"line {i} of rank {rank}" for i in range(3)]
        assert f"[rank {rank}] line 2 of rank {rank}" in printed
    assert run.exit_codes == {0: 0, 1: 0}
    assert not processes_of_run(run.run_dir)


def test_echo_rank0_shows_only_rank0(capsys):
    launch(str(SCRIPTS / "print_lines.py"), 2, echo="rank0")
    out = capsys.readouterr().out
    assert "[rank 0] line 0 of rank 0" in out and "[rank 1]" not in out


def test_failing_rank_stops_the_group_fast_and_keeps_its_metrics():
    args = TINY + ["--fail-at-step", "5", "--fail-rank", "1", "--fail-mode", "raise"]
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(ddp_tutorial.TRAIN_SCRIPT, 2, args, timeout=90)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.exit_code == 1
    assert "RuntimeError: injected failure on rank 1 at step 5" in err.traceback
    assert "rank 1" in str(err) and "exit code 1" in str(err) and "Traceback" in str(err)
    # The traceback starts in the script: no launcher frames, no second rank prefix.
    lines = err.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "train.py" in lines[1]
    assert "bootstrap.py" not in err.traceback and "[rank1]:" not in err.traceback
    # Fail-fast: far from the 90 s deadline (the launch itself takes a few seconds).
    assert elapsed < 30
    # Nothing lost: rank 1 finished steps 0..4 before it failed, flushed to disk.
    assert [s["step"] for s in err.run.steps[1]] == [0, 1, 2, 3, 4]
    assert not processes_of_run(err.run.run_dir)
    assert not any(pid_alive(p) for p in err.run.pids)


def test_nonzero_exit_is_reported_with_its_code():
    args = TINY + ["--fail-at-step", "2", "--fail-rank", "0", "--fail-mode", "exit"]
    with pytest.raises(WorkerError) as info:
        launch(ddp_tutorial.TRAIN_SCRIPT, 2, args, timeout=90)
    assert info.value.rank == 0 and info.value.exit_code == 3
    assert "exit code 3" in str(info.value)
    assert "injected failure (exit) at step 2" in info.value.traceback
    assert not processes_of_run(info.value.run.run_dir)


def test_hung_rank_becomes_launch_timeout_naming_ranks_and_steps():
    args = TINY + ["--fail-at-step", "3", "--fail-rank", "1", "--fail-mode", "hang"]
    # Warm, torch imported by the forkserver first: the deadline covers the torch._dynamo import in
    # DDP's constructor (about 1.2 CPU-s a rank) and two tiny steps on a busy machine. Cold (macOS's
    # default), it covers each rank's import of torch too.
    deadline = 12 if warm_ready() else 30
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(ddp_tutorial.TRAIN_SCRIPT, 2, args, timeout=deadline)
    elapsed = time.monotonic() - t0
    err = info.value
    assert deadline <= elapsed < 2 * deadline
    # rank 1 hangs before step 3; rank 0 finishes step 2 then waits in step 3's all-reduce.
    assert err.still_running == {0: 2, 1: 2}
    assert "rank 0 at step 2" in str(err) and "rank 1 at step 2" in str(err)
    assert not processes_of_run(err.run.run_dir)


def test_skipped_all_reduce_hangs_until_the_deadline():
    deadline = 6 if warm_ready() else 30  # warm ranks: the deadline covers the hang, not torch's import
    with pytest.raises(LaunchTimeout) as info:
        launch(str(SCRIPTS / "skip_allreduce.py"), 2, timeout=deadline)
    err = info.value
    assert set(err.still_running) == {0, 1}
    # Rank 1's second all_reduce paired with rank 0's first: both got past it, then hung.
    assert all([r["phase"] for r in err.run.results(rank)] == ["before", "after skip"] for rank in (0, 1))
    assert not processes_of_run(err.run.run_dir)


def test_wrong_world_size_times_out_in_init():
    with pytest.raises(LaunchTimeout) as info:
        launch(ddp_tutorial.scripts_path("hello.py"), 2, env={"WORLD_SIZE": "3"}, timeout=5)
    assert info.value.still_running == {0: None, 1: None}
    assert "before its first step" in str(info.value)
    assert not processes_of_run(info.value.run.run_dir)


def test_keyboard_interrupt_stops_all_workers_within_3s(runs_root):
    run_dir = runs_root / "interrupted"
    interrupted_at = {}

    def interrupt_when_running():
        # 2 ranks, each with one grandchild: interrupt once all four exist.
        wait_for(lambda: len(processes_of_run(run_dir)) == 4, 60, "workers to start")
        interrupted_at["t"] = time.monotonic()
        _thread.interrupt_main()

    thread = threading.Thread(target=interrupt_when_running, daemon=True)
    # As in a kernel, SIGINT raises KeyboardInterrupt: a test runner started in the background
    # (nohup, `&` without job control) inherits SIGINT ignored, and interrupt_main does nothing then.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(str(SCRIPTS / "sleep_forever.py"), 2, run_dir=run_dir, timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    stopped_in = time.monotonic() - interrupted_at["t"]
    thread.join()
    assert stopped_in < 3.0
    assert not processes_of_run(run_dir)


LAUNCH_IN_CHILD = """
import sys, ddp_tutorial
ddp_tutorial.launch(sys.argv[1], 2, run_dir=sys.argv[2], timeout=120)
"""


def _sigint_as_in_a_kernel():
    """SIGINT back to its default before exec, so Python turns it into KeyboardInterrupt (a runner
    started in the background, e.g. with nohup, would otherwise pass it on ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_launcher_process(run_dir):
    """A separate Python process running launch(), like a notebook kernel; waits until ranks run."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH_IN_CHILD, str(SCRIPTS / "sleep_forever.py"),
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_sigint_as_in_a_kernel)
    seen, end = "", time.monotonic() + 60
    while seen.count("child ") < 2:
        assert time.monotonic() < end, f"workers did not start: {seen}"
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            seen += os.read(proc.stdout.fileno(), 4096).decode()
    return proc


def test_sigint_to_the_kernel_process_stops_workers(runs_root):
    run_dir = runs_root / "sigint"
    proc = start_launcher_process(run_dir)
    wait_for(lambda: len(processes_of_run(run_dir)) == 4, 10, "2 ranks and 2 grandchildren")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what Jupyter's stop button does
    proc.wait(timeout=10)
    assert time.monotonic() - t0 < 3.0
    assert proc.returncode != 0
    assert not processes_of_run(run_dir)


def test_killed_kernel_leaves_no_orphans(runs_root):
    run_dir = runs_root / "killed"
    proc = start_launcher_process(run_dir)
    wait_for(lambda: len(processes_of_run(run_dir)) == 4, 10, "2 ranks and 2 grandchildren")
    proc.kill()  # SIGKILL: no Python cleanup runs in the launcher
    proc.wait()
    # Each rank reads end-of-file on the launcher's watch socket and kills its process group,
    # itself and what it started (rank/bootstrap.py, die_with_launcher).
    wait_for(lambda: not processes_of_run(run_dir), 5, "ranks and their children to die")


def _is_rank(pid: int) -> bool:
    return launcher.BOOTSTRAP in (cmdline(pid) or ())


CONCURRENT = """
import sys, ddp_tutorial
run = ddp_tutorial.launch(ddp_tutorial.scripts_path("hello.py"), 2, echo="none", timeout=120)
print("PORT", run.master_port, "SUM", run.result(0, "all_reduce_sum"), run.result(1, "all_reduce_sum"))
"""


def test_three_concurrent_launches_from_separate_processes(runs_root):
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
        assert "SUM 3.0 3.0" in out
    ports = {line.split()[1] for out in outputs for line in out.splitlines() if line.startswith("PORT")}
    assert len(ports) == 3
    assert len(list(runs_root.iterdir())) == 3  # three run folders, nothing shared


def test_each_launch_gets_its_own_run_folder_and_never_overwrites(runs_root):
    a = launch(str(SCRIPTS / "print_lines.py"), 1, echo="none")
    b = launch(str(SCRIPTS / "print_lines.py"), 1, echo="none")
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent == runs_root.resolve()
    (a.run_dir / "rank0.jsonl").write_text("{}\n")
    with pytest.raises(LaunchConfigError, match="not empty"):
        launch(str(SCRIPTS / "print_lines.py"), 1, run_dir=a.run_dir)


def test_nccl_without_enough_gpus_is_refused(runs_root, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(LaunchConfigError, match="needs CUDA"):
            launch(ddp_tutorial.TRAIN_SCRIPT, 2, backend="nccl")
        with pytest.raises(LaunchConfigError, match="needs CUDA"):
            launch(ddp_tutorial.TRAIN_SCRIPT, 2, ["--backend", "nccl"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LaunchConfigError, match="2 ranks but has 1 GPU"):
        launch(ddp_tutorial.TRAIN_SCRIPT, 2, backend="nccl")
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_hard_coded_port_in_use_fails_clearly(runs_root):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(WorkerError) as info:
            launch(ddp_tutorial.scripts_path("hello.py"), 1, master_port=port, timeout=60)
    assert "address already in use" in info.value.traceback.lower()
    # notebook 01 tells this failure from others by that message
    from ddp_tutorial.lessons.init_wrap import is_address_in_use

    other = WorkerError("rank 0 failed", 0, 1, "RuntimeError: injected failure")
    assert is_address_in_use(info.value) and not is_address_in_use(other)


def assert_launch_facts(run, world_size: int):
    """What ``launch`` puts on a Run besides the run folder, for any outcome."""
    assert set(run.exit_codes) == set(run.output) == set(range(world_size))
    assert all(code is not None for code in run.exit_codes.values())  # every rank was reaped
    assert len(run.pids) == world_size and isinstance(run.master_port, int)
    assert run.start_mode in ("warm", "cold") and (run.cold_reason is None) == (run.start_mode == "warm")
    assert run.wall_seconds is not None and run.wall_seconds > 0


def test_every_outcome_carries_the_launch_facts_on_its_run():
    assert_launch_facts(launch(str(SCRIPTS / "print_lines.py"), 2, echo="none", timeout=60), 2)
    with pytest.raises(WorkerError) as failed:
        launch(str(SCRIPTS / "fail_fast.py"), 2, echo="none", timeout=60)
    assert_launch_facts(failed.value.run, 2)
    assert failed.value.run.exit_codes[failed.value.rank] == failed.value.exit_code
    with pytest.raises(LaunchTimeout) as hung:
        launch(ddp_tutorial.scripts_path("hello.py"), 2, env={"WORLD_SIZE": "3"}, echo="none", timeout=2)
    assert_launch_facts(hung.value.run, 2)
    run = hung.value.run  # every rank stopped by a signal; if not, what it said and wrote
    assert all(code < 0 for code in run.exit_codes.values()), (run.exit_codes, run.start_mode, run.output,
                                                               sorted(p.name for p in run.run_dir.rglob("*")))


def test_the_launch_spec_is_checked_once_and_frozen(runs_root):
    import dataclasses

    spec = launcher.LaunchSpec.build(ddp_tutorial.scripts_path("hello.py"), 2, ["--n", 3], timeout=10,
                                     backend="auto", run_dir=None, env={"A": "1"}, echo="none",
                                     max_restarts=0, master_port=None, grace=1.0, warm=None)
    assert spec.args == ("--n", "3") and spec.world_size == 2
    assert (spec.run_dir / ".launch.json").is_file()  # a spec owns its claimed run folder
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.world_size = 3
    with pytest.raises(TypeError):
        spec.env["B"] = "2"
    script = str(Path(ddp_tutorial.scripts_path("hello.py")).resolve())
    assert spec.cmd == [sys.executable, "-u", launcher.BOOTSTRAP, script, "--n", "3"]


def test_rank0_keeps_the_store_until_the_other_ranks_exit():
    # As torchrun's agent does: a rank still using the store after rank 0's script ended is served.
    run = launch(str(SCRIPTS / "store_outlives_rank0.py"), 2)
    assert run.exit_codes == {0: 0, 1: 0}
    assert any(line.startswith("the store answered") for line in run.output[1]), run.output[1]


def test_rank0_holding_the_store_exits_0_when_a_later_rank_fails():
    # Rank 0's script succeeded; launch stops it when rank 1 fails, and its exit code says it succeeded.
    with pytest.raises(WorkerError) as info:
        launch(str(SCRIPTS / "store_outlives_rank0.py"), 2, args=["--then-fail"])
    assert info.value.rank == 1 and info.value.exit_code == 3
    assert info.value.run.exit_codes[0] == 0


def test_a_launching_script_without_a_main_guard_launches_once(tmp_path):
    # Warm ranks come from multiprocessing's forkserver, which would re-run the launching
    # program's __main__ in every rank; a rank must run only its own script, as under torchrun.
    launcher_script = tmp_path / "launch_it.py"
    launcher_script.write_text(
        "from ddp_tutorial import launch\n"
        "print('launching', flush=True)\n"
        f"launch({str(SCRIPTS / 'print_lines.py')!r}, 2, run_dir={str(tmp_path / 'run')!r})\n")
    done = subprocess.run([sys.executable, str(launcher_script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DDP_TUTORIAL_WARM": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("launching") == 1, done.stdout
    assert "[rank 1] line 2 of rank 1" in done.stdout


def test_the_forkserver_does_not_preload_torch_dynamo():
    """With ``torch._dynamo``, or what it imports, imported before ``init_process_group``, a script that
    leaves the group before dropping its DDP model hangs now and then where torchrun's ranks did not:
    warm ranks must not start with them (docs/warm-launches.md, docs/measured.md)."""
    # Only what the preload adds to what a DDP script's own imports bring (on torch 2.13 and 2.15: nothing).
    code = ("import importlib, sys\n"
            "WATCHED = ('torch._dynamo', 'torch._inductor', 'sympy', 'torch.fx.experimental.symbolic_shapes',\n"
            "           'torch.distributed.tensor', 'torch.distributed.fsdp')\n"
            "import torch, torch.distributed, torch.nn.parallel\n"
            "own = {m for m in WATCHED if m in sys.modules}\n"
            "from ddp_tutorial.launcher.warm import PRELOAD\n"
            "for name in PRELOAD:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in WATCHED if m in sys.modules and m not in own))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
