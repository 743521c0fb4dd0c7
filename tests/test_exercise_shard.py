"""Exercise "shard" (ZeRO-1): typical wrong answers fail on real ranks with a message that names the mistake.

The reference solution and the untouched skeleton are checked with every
other exercise in ``test_exercises.py``; these are the wrong answers, each in
``tests/exercise_mistakes/shard_<mistake>.py``, what the judge's measurements
must say about them, and right answers shaped otherwise than the solution
(``tests/exercise_right_answers/``). The judge's handling of evidence a run
never produced is tested on records made by hand: no launch.
"""

import pytest

from ddp_tutorial import exercises
from ddp_tutorial.lessons.sharding import shard_judge as shard
from ddp_tutorial.exercises.runs import HarnessRun
from test_exercises import (  # noqa: F401
    MISTAKES, RIGHT_ANSWERS, TIMEOUT, assert_nothing_left, failed, in_tmp_folder, passed_names, run_records)

# (file in exercise_mistakes/, {criterion that fails: words its message must say}, criteria still passing)
WRONG_ANSWERS = [
    # ZeRO's state_dict() raises on a rank that did not consolidate: the run fails, and the check says why.
    ("shard_no_consolidate",
     {"runs to the end": ["rank 0 failed", "has not been consolidated"],
      "rank 0's checkpoint": ["without consolidate_state_dict()", "on every rank first"]},
     [shard.SHARDED, shard.SAME_AS_DDP]),
    ("shard_consolidate_rank0_only",
     {"rank 0's checkpoint": ["ran on rank 0 only, not on rank 1", "it is a collective",
                              "every rank takes part in each of those broadcasts"]},
     [shard.SHARDED]),
    ("shard_default_lr",
     {"final parameters equal the DDP script's": ["learning rate is 0.001", "Adam's default", "used 0.01"]},
     [shard.SHARDED, shard.CHECKPOINT]),
    # Consolidated at the top of each epoch: rank 0's own shard is saved as training left it (14 steps), the
    # other rank's as it was at the top of the last epoch (7): a torn state that used to pass.
    ("shard_consolidate_each_epoch",
     {"rank 0's checkpoint": ["ran on rank 0 after 0 and 7 of the 14 optimizer steps, never after the last",
                              "{0: 14, 1: 7, 2: 7, 3: 7}", "at the end {0: 14, 1: 14, 2: 14, 3: 14}"]},
     [shard.SHARDED, shard.SAME_AS_DDP]),
    # Every rank consolidates to 0, then every rank calls state_dict(): rank 1 did consolidate.
    ("shard_every_rank_state_dict",
     {"rank 0's checkpoint": ["rank 1 called optimizer.state_dict() after consolidate_state_dict(to=0)",
                              "Only the target, rank 0, holds the gathered state"]},
     [shard.SHARDED, shard.SAME_AS_DDP]),
    # The optimizer holds a second model's parameters: no gradient ever reaches them, so no state, no update.
    ("shard_other_model",
     {"Adam's state is sharded": ["together 0 bytes", "not those of the model DDP wraps"],
      "final parameters equal": ["never got a gradient"],
      "rank 0's checkpoint": ["the saved optimizer state is empty", "not those of the model DDP wraps"]},
     []),
    ("shard_no_set_epoch",
     {"final parameters equal": ["epoch 1 repeated epoch 0's order", "sampler.set_epoch(epoch)"]},
     [shard.SHARDED, shard.CHECKPOINT]),
    # A valid constructor call: the harness must not crash on it (it read zero.optim, which does not exist yet).
    ("shard_overlap_no_hook",
     {"runs to the end": ["rank ", "should not be called until this ZeroRedundancyOptimizer instance has been "
                          "fully initialized"],
      "final parameters equal": ["with overlap_with_ddp=True", "optimizer.step() does nothing"]},
     []),
]


@pytest.mark.parametrize("mistake, failing, still_passing", WRONG_ANSWERS, ids=[w[0] for w in WRONG_ANSWERS])
def test_a_wrong_answer_fails_naming_the_mistake(mistake, failing, still_passing, tmp_path):
    result = exercises.check("shard", MISTAKES / f"{mistake}.py", timeout=TIMEOUT)
    assert not result.passed
    for criterion, words in failing.items():
        detail = failed(result, criterion)
        for word in words:
            assert word in detail, f"{word!r} not in {detail!r}"
    assert set(still_passing) <= passed_names(result), result.message
    harness_frames = [f for f in ("shard_records.py", "observers.py") if f in result.message]
    assert not harness_frames, result.message  # the whole message: which part named a harness file
    assert_nothing_left(result, tmp_path)


def test_a_failed_rank_waits_for_a_peer_still_finishing_its_script(tmp_path):
    """Rank 1 fails; rank 0 goes on only once rank 1's harness has marked its reports written (a causal hold).
    Rank 0's save, ``shard_final`` and reference are
    still measured: the failed rank's exit, which stops the group, waits for them."""
    # The mistake "shard_every_rank_state_dict" (rank 1 fails at state_dict()), with rank 0 held back until rank 1's
    # harness has marked its reports written (shard_reports/1 in the group's store): rank 1 has failed by then.
    source = (MISTAKES / "shard_every_rank_state_dict.py").read_text()
    hold = ("    optimizer.consolidate_state_dict(to=0)\n"
            "    if rank == 0:\n"
            "        from datetime import timedelta\n"
            "        dist.distributed_c10d._get_default_store().wait([\"shard_reports/1\"], timedelta(seconds=60))\n")
    assert source.count("    optimizer.consolidate_state_dict(to=0)\n") == 1
    script = tmp_path / "shard_rank0_behind_a_failed_peer.py"
    script.write_text(source.replace("    optimizer.consolidate_state_dict(to=0)\n", hold))
    result = exercises.check("shard", script, timeout=TIMEOUT)
    assert "rank 1 called optimizer.state_dict() after consolidate_state_dict(to=0)" in failed(result, "rank 0's checkpoint")
    assert {shard.SHARDED, shard.SAME_AS_DDP} <= passed_names(result), result.message
    rank0 = [r.get("event") for r in run_records(tmp_path, "shard")[0]]
    assert "shard_final" in rank0 and "shard_reference" in rank0
    assert_nothing_left(result, tmp_path)


def test_a_run_that_stopped_before_the_save_says_not_measured_not_a_false_reason(tmp_path):
    """Rank 0 fails on the line that saves: the checkpoint was never written, so nothing is said about it."""
    result = exercises.check("shard", MISTAKES / "shard_crash_before_save.py", timeout=TIMEOUT)
    assert "checkpoint_pth" in failed(result, "runs to the end")
    checkpoint = failed(result, "rank 0's checkpoint")
    assert checkpoint.startswith("not measured:") and "keep the script's torch.save" not in checkpoint
    assert {shard.SHARDED, shard.SAME_AS_DDP} <= passed_names(result)  # measured before the crash
    assert result.message.count("✗") == 1
    assert_nothing_left(result, tmp_path)


def test_a_right_answer_in_another_shape_passes(tmp_path):
    """A list of the wrapped module's parameters, Adam by position, consolidated and saved every epoch."""
    result = exercises.check("shard", RIGHT_ANSWERS / "shard_params_list.py", timeout=TIMEOUT)
    assert result.passed, result.message
    assert_nothing_left(result, tmp_path)


@pytest.mark.parametrize("answer", ["shard_join", "shard_comm_hook", "shard_async_log"])
def test_a_right_answer_that_hands_torch_its_own_work_handles_passes(tmp_path, answer):
    """Under Join([model, optimizer]) DDP's reducer takes the Work of Join's all-reduce (it must be torch's
    own, not the harness's); a comm hook returns torch's future; an async all_reduce the script waits for."""
    result = exercises.check("shard", RIGHT_ANSWERS / f"{answer}.py", timeout=TIMEOUT)
    assert result.passed, result.message
    assert_nothing_left(result, tmp_path)


def test_the_solution_holds_an_uneven_share_and_saves_it_whole(tmp_path):
    """The measured numbers behind the ✓s: ZeRO's greedy split of the 4 -> 8 -> 2 model, 32 and 26 elements;
    rank 0 reports what it measured before it replays the DDP script (a peer's failure cannot cost them)."""
    result = exercises.check("shard", exercises.EXERCISES["shard"].solution, timeout=TIMEOUT)
    details = {name: detail for name, _, detail in result.criteria}
    assert "rank 0: 260 bytes, rank 1: 220 bytes; together 480 = one copy" in details[shard.SHARDED]
    assert "4 of 4 parameters' Adam state, 480 bytes, each at step 14 as training left it" in details[shard.CHECKPOINT]
    events = [r.get("event") for r in run_records(tmp_path, "shard")[0]]
    assert events.index("shard_final") < events.index("shard_reference")
    assert_nothing_left(result, tmp_path)


# -- Evidence a run never produced: "not measured", never a false ✗ (records made by hand) -------------
def final(rank, **changes):
    """A ``shard_final`` record as the harness writes it for a correct ZeRO-1 run that stepped 14 times."""
    shares = {0: [0], 1: [1, 2, 3]}
    record = {"event": "shard_final", "optimizer": "ZeroRedundancyOptimizer", "local_optimizer": "Adam",
              "lr": shard.LR, "state_bytes": 260 if rank == 0 else 220, "optimizer_steps": 14, "param_tensors": 4,
              "full_state_bytes": 480, "final_params": [0.5] * 58,
              "held_state": [[i, {"step": 14.0, "values": [0.1]}] for i in shares[rank]],
              "trains_ddp_model": True, "params_with_grad": 4, "overlap_with_ddp": False,
              "consolidations": [{"to": 0, "after_steps": 14}], "state_dict_refused": None,
              "saved_optimizer_states": [{"params_with_state": 4, "state_bytes": 480, "after_steps": 14,
                                          "state": [[i, {"step": 14.0, "values": [0.1]}] for i in range(4)]}]
              if rank == 0 else []}
    return {**record, **changes}


def a_run(records, failed_rank=None):
    run = HarnessRun("launch", 2, 90.0, records=records)
    if failed_rank is not None:
        run.failed_rank, run.failure = failed_rank, f"rank {failed_rank} failed (exit code 1)"
    return run


def test_rank_0_stopped_during_its_replay_keeps_what_it_measured():
    """Rank 1 failed after rank 0's script ended: the launcher stopped rank 0 before its reference."""
    run = a_run({0: [final(0)], 1: [final(1)]}, failed_rank=1)
    criteria = {name: (passed, detail) for name, passed, detail in shard.judge_shard(run)}
    assert criteria[shard.SHARDED][0], criteria[shard.SHARDED]  # measured before the replay: still judged
    same = criteria[shard.SAME_AS_DDP][1]
    assert same.startswith("not measured:") and "rank 1 failed" in same
    assert "no optimizer stepped" not in same and "computed no reference (its script failed)" not in same


def test_zero_without_its_hook_is_named_even_when_rank_0_was_stopped_before_its_reference():
    """overlap_with_ddp=True: both ranks crash in consolidate_state_dict; rank 1 first, and the launcher
    stopped rank 0 before it computed the reference (the order varies from run to run)."""
    never = dict(local_optimizer=None, overlap_with_ddp=True, state_bytes=0, held_state=[], consolidations=[])
    run = a_run({0: [final(0, **never)], 1: [final(1, **never)]}, failed_rank=1)
    criteria = {name: (passed, detail) for name, passed, detail in shard.judge_shard(run)}
    passed, detail = criteria[shard.SAME_AS_DDP]
    assert not passed and "with overlap_with_ddp=True" in detail and "optimizer.step() does nothing" in detail
    assert detail.startswith("no parameter changed on rank 0, rank 1: ")


def test_a_rank_that_reported_nothing_is_named_as_not_measured():
    run = a_run({0: [final(0), {"event": "shard_reference", "reference": [0.5] * 58, "reference_steps": 14,
                                "reference_state_bytes": 480}], 1: []}, failed_rank=1)
    for name, passed, detail in shard.judge_shard(run)[1:]:
        assert detail.startswith("not measured:"), (name, detail)
        assert "no optimizer stepped" not in detail and "inf" not in detail


def test_a_run_that_stopped_mid_training_compares_no_parameters():
    """Parameters after 5 of 14 steps are not "final": no "differ by up to ..." (it said inf, or a number)."""
    records = {0: [final(0, optimizer_steps=5, saved_optimizer_states=[]),
                   {"event": "shard_reference", "reference": [0.1] * 58, "reference_steps": 14,
                    "reference_state_bytes": 480}],
               1: [final(1, optimizer_steps=5)]}
    criteria = {name: detail for name, _, detail in shard.judge_shard(a_run(records, failed_rank=1))}
    assert criteria[shard.SAME_AS_DDP].startswith("not measured:") and "5" in criteria[shard.SAME_AS_DDP]
    assert criteria[shard.CHECKPOINT].startswith("not measured:")
