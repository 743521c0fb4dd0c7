"""train.py: exact equivalence with one big batch, skipped communication, and each fixed bug."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddp_tutorial
from ddp_tutorial import Run, launch, mistakes, train
from ddp_tutorial.rank import original

# 256 samples divide evenly by W*b*K = 16, so no sampler padding duplicates samples.
COMMON = ["--dataset-size", "256", "--epochs", "2", "--seed", "3", "--lr", "0.05"]


def plain_process(out: Path, args) -> Run:
    """`python -m ddp_tutorial.train` with no torchrun variables: a single process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run([sys.executable, "-m", "ddp_tutorial.train", "--out", str(out), *args],
                   env=env, check=True, capture_output=True, timeout=120)
    return Run(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch 16, no accumulation: what every (W, b, K) with W*b*K = 16 must match."""
    run = plain_process(tmp_path_factory.mktemp("ref"), COMMON + ["--batch-size", "16",
                                                                 "--accum-steps", "1"])
    assert run.summaries[0]["backend"] == "none" and run.summaries[0]["world_size"] == 1
    return run.model_state()


def assert_same_params(a: dict, b: dict, atol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), (
            f"{name}: max diff {(a[name] - b[name]).abs().max():.2e}")


@pytest.mark.parametrize("world_size, batch_size, accum_steps", [(1, 4, 4), (2, 4, 2), (4, 2, 2)])
def test_ranks_times_batch_times_accumulation_equals_one_big_batch(reference, world_size, batch_size,
                                                                    accum_steps):
    run = launch(ddp_tutorial.TRAIN_SCRIPT, world_size,
                 COMMON + ["--batch-size", batch_size, "--accum-steps", accum_steps,
                           "--straggler-ms", "1"], echo="none")
    assert_same_params(run.model_state(), reference)
    # Every rank ends with the same parameters (DDP kept them in step).
    checksums = {s["param_checksum"] for s in run.summaries.values()}
    assert len(run.summaries) == world_size and max(checksums) - min(checksums) < 1e-9


def test_unscaled_loss_breaks_the_equivalence(reference):
    run = launch(ddp_tutorial.TRAIN_SCRIPT, 2, COMMON + ["--batch-size", "4", "--accum-steps", "2",
                                                         "--bug", "loss-not-scaled"], echo="none")
    state = run.model_state()
    assert not all(torch.allclose(state[k], reference[k], atol=1e-5, rtol=0) for k in state)


def test_the_same_script_runs_under_torchrun(reference, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / "torchrun"
    proc = subprocess.run(
        torchrun + ["--standalone", "--nproc-per-node", "2", "-m", "ddp_tutorial.train", "--out", str(out),
                    *COMMON, "--batch-size", "4", "--accum-steps", "2"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PET_LOG_DIR": str(tmp_path / "torchrun-logs")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = Run(out)
    assert run.ranks == [0, 1] and run.summaries[1]["backend"] == "gloo"
    assert_same_params(run.model_state(), reference)


TWO_WINDOWS = ["--dataset-size", "64", "--batch-size", "4", "--epochs", "1", "--accum-steps", "4"]


def buckets(run: Run):
    """DDP's bucket count before and after its first-iteration rebuild."""
    logging = run.summaries[0]["ddp_logging"]
    initial = len(str(logging["bucket_sizes"]).split(","))
    rebuilt = len(str(logging["rebuilt_bucket_sizes"]).split(",")) if logging["rebuilt_bucket_sizes"] else initial
    return initial, rebuilt


@pytest.mark.parametrize("bug, expected_calls", [(None, 2), ("forward-outside-no-sync", 8)])
def test_no_sync_skips_all_reduces_only_with_forward_inside(bug, expected_calls):
    """2 ranks, K=4, 8 micro-steps, one bucket: forward inside no_sync -> 2 all-reduces; outside -> 8."""
    run = launch(ddp_tutorial.TRAIN_SCRIPT, 2, TWO_WINDOWS + (["--bug", bug] if bug else []), echo="none")
    assert buckets(run) == (1, 1)
    for rank in (0, 1):
        assert len(run.steps[rank]) == 8 and run.optimizer_steps(rank) == 2
        assert run.allreduce_calls(rank) == expected_calls
        # Optimizer steps on the last micro-batch of each window of 4.
        assert [s["micro"] for s in run.steps[rank] if s["optimizer_step"]] == [3, 7]
    if bug is None:
        assert run.allreduce_calls(0) == run.optimizer_steps(0) * 1  # optimizer steps x buckets
        assert all(s["sync_s"] == 0 for s in run.steps[0] if not s["sync"])


def test_all_reduces_equal_optimizer_steps_times_buckets():
    """With small buckets: one all-reduce per bucket per optimizer step (DDP rebuilds buckets after step 1)."""
    run = launch(ddp_tutorial.TRAIN_SCRIPT, 2, TWO_WINDOWS + ["--bucket-cap-mb", "0.004"], echo="none")
    initial, rebuilt = buckets(run)
    assert rebuilt >= 2
    steps = run.optimizer_steps(0)
    assert run.allreduce_calls(0) == initial + (steps - 1) * rebuilt
    assert [s["allreduce_calls"] for s in run.sync_steps(0)] == [initial] + [rebuilt] * (steps - 1)


def test_sync_schedule_steps_on_the_last_micro_batch_of_each_window():
    F, T = False, True
    assert train.sync_schedule(8, 4) == [F, F, F, T, F, F, F, T]
    assert train.loss_divisors(8, 4) == [4] * 8
    # The original: first update after a single micro-batch, and no loss divided by K.
    assert original.sync_schedule(8, 4) == [T, F, F, F] * 2
    assert original.loss_divisors(8, 4) == [1] * 8
    # A trailing partial window still steps, with its loss divided by its own size.
    assert train.sync_schedule(6, 4) == [F, F, F, T, F, T]
    assert train.loss_divisors(6, 4) == [4, 4, 4, 4, 2, 2]
    assert train.sync_schedule(3, 1) == [T] * 3 and train.loss_divisors(3, 1) == [1] * 3


def run_in_process(tmp_path, *args) -> Run:
    """train.main in this process, without torchrun variables (a single process, no DDP)."""
    out = tmp_path / "_".join(a.strip("-") for a in args if a.startswith("--")) / "run"
    assert train.main(["--out", str(out), *args]) == 0
    return Run(out)


def test_trailing_partial_window_is_not_dropped(tmp_path):
    # 24 samples, batch 4 -> 6 micro-batches; K=4 -> steps after micro 3 and 5.
    run = run_in_process(tmp_path, "--dataset-size", "24", "--batch-size", "4", "--epochs", "1",
                         "--accum-steps", "4")
    assert [s["micro"] for s in run.steps[0] if s["optimizer_step"]] == [3, 5]


def test_sync_schedule_bug_steps_after_the_first_micro_batch(tmp_path):
    run = run_in_process(tmp_path, *TWO_WINDOWS, "--bug", "sync-schedule")
    # one process: 16 micro-batches; the original steps at 0, 4, 8, 12 and drops the last 3
    assert [s["micro"] for s in run.steps[0] if s["optimizer_step"]] == [0, 4, 8, 12]


def test_teacher_labels_can_be_learned_and_random_labels_cannot(tmp_path):
    args = ["--dataset-size", "512", "--batch-size", "16", "--epochs", "4", "--accum-steps", "1"]

    def first_and_last_quarter(run):
        loss = run.column(0, "loss")
        q = len(loss) // 4
        return sum(loss[:q]) / q, sum(loss[-q:]) / q

    first, last = first_and_last_quarter(run_in_process(tmp_path, *args))
    assert last < 0.25 * first
    first, last = first_and_last_quarter(run_in_process(tmp_path, *args, "--bug", "random-labels"))
    assert last > 0.5 * first  # nothing to learn: the loss stays near its floor of noise


def test_every_rank_builds_the_same_dataset_unless_the_bug_is_on(monkeypatch):
    def inputs_of(rank: int, bugs=()):
        monkeypatch.setenv("RANK", str(rank))
        with original.mistakes(bugs, train):  # as train.main runs it with --bug
            return train.make_inputs(32, seed=5)

    assert torch.equal(inputs_of(0), inputs_of(1))
    assert not torch.equal(inputs_of(0, ["per-rank-data"]), inputs_of(1, ["per-rank-data"]))
    assert torch.equal(inputs_of(1, ["per-rank-data"]), original.make_inputs(32, 5, rank=1))
    # After the block, train.py's own version is back.
    assert train.make_inputs is not original.make_inputs and torch.equal(inputs_of(1), inputs_of(0))
    # One teacher: the same inputs get the same targets on every rank.
    a, b = (train.make_dataset(inputs_of(0), seed=5) for _ in range(2))
    assert torch.equal(a.tensors[1], b.tensors[1])


def test_shards_are_disjoint_and_set_epoch_reshuffles():
    dataset = train.make_dataset(train.make_inputs(16, seed=0), seed=0)

    def indices(rank, epoch, set_epoch):
        _, sampler = train.make_loader(dataset, train.DistEnv(rank=rank, world_size=2), 4, seed=0)
        if set_epoch:
            sampler.set_epoch(epoch)
        return list(sampler)

    for epoch in (0, 1):
        r0, r1 = indices(0, epoch, True), indices(1, epoch, True)
        assert not set(r0) & set(r1) and set(r0) | set(r1) == set(range(16))
    assert indices(0, 0, True) != indices(0, 1, True)
    assert indices(0, 0, False) == indices(0, 1, False)  # forgetting set_epoch: same order forever


def test_metrics_have_one_flushed_line_per_micro_step_with_timings():
    run = launch(ddp_tutorial.TRAIN_SCRIPT, 2, TWO_WINDOWS + ["--straggler-ms", "4", "--epochs", "2"],
                 echo="none")
    for rank in run.ranks:
        steps = run.steps[rank]
        assert [s["step"] for s in steps] == list(range(16))
        assert [s["epoch"] for s in steps] == [0] * 8 + [1] * 8
        for s in steps:
            for key in ("forward_s", "backward_s", "optimizer_s", "straggler_s", "sync_s", "step_s"):
                assert s[key] >= 0
            assert s["straggler_s"] <= 0.004 + 0.05  # a sleep of 0..4 ms (plus scheduler slack)
            assert s["step_s"] >= s["straggler_s"] + s["forward_s"] + s["backward_s"]
            assert (s["sync_s"] > 0) == s["sync"] == (s["allreduce_calls"] > 0)
        assert sum(s["straggler_s"] for s in steps) > 0
        assert run.summaries[rank]["threads"] == 1
    assert (run.run_dir / "model.pt").exists()


def test_train_refuses_bad_flags_with_a_clear_message():
    proc = subprocess.run([sys.executable, "-m", "ddp_tutorial.train", "--accum-steps", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--accum-steps must be at least 1" in proc.stderr


def test_the_steps_without_hooks_train_exactly_like_the_instrumented_script(tmp_path):
    """The five steps with the default (no-op) hooks are plain DDP: the kit's measuring changes nothing."""
    args = ["--dataset-size", "96", "--batch-size", "4", "--epochs", "2", "--accum-steps", "4", "--seed", "3"]
    instrumented = run_in_process(tmp_path, *args).model_state()
    torch.manual_seed(3)
    env = train.init_process_group()  # no torchrun variables here: one plain process
    model = train.wrap_model(train.Model(), env)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader, sampler = train.make_loader(train.make_dataset(train.make_inputs(96, 3), 3), env, 4, 3)
    for epoch in range(2):
        train.start_epoch(sampler, epoch)
        train.train_epoch(model, loader, optimizer, train.loss_fn, 4, epoch)
    train.teardown()
    assert env == train.DistEnv() and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    assert_same_params(model.state_dict(), instrumented, atol=0)


# The functions a notebook prints as the steps: each one fits on a screen.
STEPS = ["init_process_group", "wrap_model", "make_loader", "start_epoch", "train_epoch", "micro_step",
         "teardown", "main"]


def test_each_step_prints_in_at_most_25_lines_and_the_script_in_200():
    for name in STEPS:
        lines = inspect.getsource(getattr(train, name)).splitlines()
        assert len(lines) <= 25, f"train.{name} has {len(lines)} lines"
    source = Path(train.__file__).read_text().splitlines()
    assert len([line for line in source if line.strip()]) <= 200


def test_every_bug_is_the_original_version_of_one_train_function():
    for m in (m for m in mistakes.MISTAKES if m.function):
        fixed, theirs = getattr(train, m.function), getattr(original, m.function)
        assert fixed is not theirs
        # Called as train.py calls its own: the original takes the same arguments (and maybe more).
        fixed_params = list(inspect.signature(fixed).parameters)
        assert list(inspect.signature(theirs).parameters)[:len(fixed_params)] == fixed_params
    with pytest.raises(ValueError, match="not a --bug"):
        with original.mistakes(["no-such-bug"], train):
            pass


def test_cli_runs_the_demo_and_saves_both_figures(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "ddp_tutorial", "--world-size", "2", "--epochs", "1",
                           "--dataset-size", "256", "--run-dir", str(out), "--echo", "rank0"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("sync_timeline.png", "loss_curves.png"):
        assert (out / name).stat().st_size > 10_000
        assert f"saved {out / name}" in proc.stdout
    assert "[rank 0] start" in proc.stdout and "[rank 1]" not in proc.stdout
    # --backend auto says which backend it chose, and why, once
    chosen = [line for line in proc.stdout.splitlines() if line.startswith("[rank 0] backend ")]
    assert len(chosen) == 1 and ": auto: " in chosen[0]


def test_cli_help_documents_every_flag():
    from ddp_tutorial.__main__ import build_parser

    text = build_parser().format_help()
    flags = [s for a in build_parser()._actions for s in a.option_strings if a.help != "==SUPPRESS=="]
    assert len(flags) > 20
    for flag in flags:
        assert flag in text


def test_no_ddp_model_is_left_when_the_group_is_left():
    """train.main drops its model before teardown, and the kit's hooks hold none of their own."""
    run = ddp_tutorial.launch(str(Path(__file__).parent / "scripts" / "ddp_gone_at_teardown.py"), 2,
                              ["--dataset-size", "64", "--batch-size", "4", "--epochs", "1"], echo="none")
    assert [run.result(r, "ddp_models_alive") for r in (0, 1)] == [0, 0]
