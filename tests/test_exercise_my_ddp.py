"""Exercise "my_ddp" (DDP built by hand): classic mistakes fail on real ranks with a message that names them, and
only them (one mistake, one ✗; what it upsets besides is "not measured"), and correct answers shaped unlike the
solution pass.

The reference solution and the untouched skeleton are checked with every other exercise in
``test_exercises.py``; these are the wrong answers, each in ``tests/exercise_mistakes/my_ddp_<mistake>.py``,
and the correct ones in ``tests/scripts/my_ddp_correct_*.py``.
"""

from pathlib import Path

import pytest

from ddp_tutorial import WorkerError, exercises, launch
from ddp_tutorial.exercises import judge
from ddp_tutorial.lessons.build_ddp import my_ddp_judge as my_ddp
from test_exercises import MISTAKES, TIMEOUT, assert_nothing_left, failed, in_tmp_folder, passed_names  # noqa: F401

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ALL = [my_ddp.RAN, my_ddp.BROADCAST, my_ddp.SAME, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED,
       my_ddp.ORDER]

# (file in exercise_mistakes/, {the criteria that fail (✗): words each message must say}, criteria still passing).
# Every other criterion passes or says "not measured": never a second ✗.
WRONG_ANSWERS = [
    ("my_ddp_not_divided", {my_ddp.SAME: ["not dividing by W", "2.00 times DDP's"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.ORDER]),
    ("my_ddp_divided_twice", {my_ddp.SAME: ["dividing twice", "0.500 times DDP's, 1/2"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS, my_ddp.OVERLAP]),
    ("my_ddp_no_wait", {my_ddp.SAME: ["stepping before the handles are waited for"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS]),
    ("my_ddp_divide_after_launch", {my_ddp.SAME: ["a gradient changed in place after its all-reduce was launched"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS, my_ddp.OVERLAP]),
    ("my_ddp_param_data", {my_ddp.SAME: ["all-reducing param.data instead of .grad"]}, [my_ddp.BROADCAST]),
    ("my_ddp_frozen_hook", {my_ddp.RAN: ["a hook on a frozen parameter", "doesn't require gradient"]}, []),
    ("my_ddp_no_broadcast", {my_ddp.BROADCAST: ["no broadcast at construction"]},
     [my_ddp.SAME, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_no_buffer_broadcast", {my_ddp.BROADCAST: ["the parameters are rank 0's", "buffer (shift)",
                                                       "buffers not broadcast"]},
     [my_ddp.SAME, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_bucket_order", {my_ddp.ORDER: ["Buckets built in an order that differs across ranks",
                                            "sum the wrong tensors, or wait for ever"],
                             my_ddp.RAN: ["the ranks called different collectives"]}, [my_ddp.BROADCAST]),
    ("my_ddp_rank0_broadcast", {my_ddp.ORDER: ["construction: collective #1 differs", "broadcast of", "rank 0 called",
                                               "rank 1 never called", "instead of at gloo's timeout"],
                                my_ddp.RAN: ["stopped in construction"]}, []),
    # One mistake, named twice: the copy gets the broadcasts and the hooks.
    ("my_ddp_hooks_on_a_copy", {my_ddp.SAME: ["hooks registered on another model", "none on the module it was given"],
                                my_ddp.BROADCAST: ["none of them of the module's own tensors", "went to a copy"]},
     [my_ddp.RAN]),
    ("my_ddp_one_bucket", {my_ddp.BUCKETS: ["one all-reduce a step at every cap", "bucket_cap_mb is ignored"],
                           my_ddp.OVERLAP: ["launched in the last gradient's hook", "0 of 1 all-reduces overlap"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_flat_in_last_hook", {my_ddp.BUCKETS: ["one all-reduce a step at every cap"],
                                  my_ddp.OVERLAP: ["launched in the last gradient's hook"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.NO_SYNC, my_ddp.ORDER]),
    ("my_ddp_cap_ignored", {my_ddp.BUCKETS: ["2 all-reduces a step at every cap", "do not follow bucket_cap_mb"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_per_parameter", {my_ddp.BUCKETS: ["one all-reduce per parameter at every cap (6 a step"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    # Correct averages from blocking all-reduces after backward (NaiveDDP's shape): overlap only, no false race.
    ("my_ddp_blocking_after_backward", {my_ddp.OVERLAP: ["launched after backward returned"]},
     [my_ddp.RAN, my_ddp.BROADCAST, my_ddp.SAME, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_blocking_in_last_hook", {my_ddp.OVERLAP: ["launched in the last gradient's hook"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.BUCKETS, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_blocking_in_hooks", {my_ddp.OVERLAP: ["blocking all-reduces (no async_op=True) during backward"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.BUCKETS, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_no_copy_back", {my_ddp.SAME: ["the all-reduced values never reach p.grad", "still its own, bit for bit"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.ORDER]),
    ("my_ddp_never_reset", {my_ddp.SAME: ["reset the per-step state", "[3, 0, 0] at 900 bytes",
                                          "8 launched over the 9 steps against 24"]},
     [my_ddp.BROADCAST, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.UNUSED, my_ddp.ORDER]),
    ("my_ddp_unused_silent", {my_ddp.UNUSED: ["no error", "its bucket was never all-reduced", "raise an error"]},
     [my_ddp.BROADCAST, my_ddp.SAME, my_ddp.BUCKETS, my_ddp.OVERLAP, my_ddp.NO_SYNC, my_ddp.ORDER]),
]


def crosses(result):
    """The criteria that failed with a diagnosis (✗), not for want of evidence (·)."""
    return {name for name, passed, detail in result.criteria
            if not passed and not detail.startswith(judge.NOT_MEASURED)}


@pytest.mark.parametrize("mistake, failing, still_passing", WRONG_ANSWERS, ids=[w[0] for w in WRONG_ANSWERS])
def test_a_wrong_answer_fails_naming_the_mistake(mistake, failing, still_passing, tmp_path):
    result = exercises.check("my_ddp", MISTAKES / f"{mistake}.py", timeout=TIMEOUT)
    assert not result.passed
    for criterion, words in failing.items():
        detail = failed(result, criterion[:30])
        for word in words:
            assert word in detail, f"{word!r} not in {detail!r}"
    assert crosses(result) == set(failing), result.message  # one mistake, one diagnosis
    assert set(still_passing) <= passed_names(result), result.message
    assert_nothing_left(result, tmp_path)


def test_a_collective_only_rank_0_calls_is_named_in_seconds_not_at_gloo_s_timeout(tmp_path):
    """Rank 0 waits in a broadcast rank 1 never calls: the ranks' watchdogs compare their calls through the store
    and stop the run within a second or so of rank 1 finishing its construction; gloo's own timeout is 30 s a run."""
    result = exercises.check("my_ddp", MISTAKES / "my_ddp_rank0_broadcast.py", timeout=TIMEOUT)
    assert result.seconds < 2 * 30, result.message  # both runs (W = 2 and 4) together, under one gloo timeout each
    assert "Timed out" not in result.message and my_ddp.ORDER not in passed_names(result)
    assert_nothing_left(result, tmp_path)


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("my_ddp_correct_*.py")), ids=lambda p: p.stem)
def test_a_correct_answer_shaped_unlike_the_solution_passes(script, tmp_path):
    result = exercises.check("my_ddp", script, timeout=TIMEOUT)
    assert result.passed, result.message
    assert "on 2 and 4 ranks" in result.message
    assert_nothing_left(result, tmp_path)


def test_there_are_enough_wrong_and_right_answers():
    assert len(WRONG_ANSWERS) >= 5 and len(list(SCRIPTS.glob("my_ddp_correct_*.py"))) >= 3
    assert {w[0] for w in WRONG_ANSWERS} == {p.stem for p in MISTAKES.glob("my_ddp_*.py")}


def test_the_untouched_skeleton_gets_no_tick_but_for_running(tmp_path):
    """No criterion passes on nothing: with no all-reduce at all, order, buckets and overlap are not measured."""
    exercises.start("my_ddp")
    result = exercises.check("my_ddp", timeout=TIMEOUT)  # runs my_work/my_ddp.py, as the notebook does
    assert "exercises.hint('my_ddp')" in result.message and "on 2 ranks; 4 once these pass" in result.message
    assert passed_names(result) == {my_ddp.RAN}, result.message
    assert failed(result, my_ddp.ORDER[:30]).startswith("not measured: no rank launched an all-reduce")
    assert crosses(result) == {my_ddp.BROADCAST, my_ddp.SAME}, result.message
    assert_nothing_left(result, tmp_path)


def test_the_reference_solution_raises_when_its_all_reduce_fails():
    """A peer that never joins: rank 0's all-reduce fails at gloo's 3 s timeout, and handle.wait() raises it."""
    with pytest.raises(WorkerError) as info:
        launch(str(SCRIPTS / "my_ddp_peer_never_joins.py"), 2, echo="none", timeout=60)
    err = info.value
    assert err.rank == 0 and "finish_gradient_synchronization" in err.traceback
    assert "rank 0 returned" not in "\n".join(err.run.output[0])


def test_the_bucket_rules_as_stated():
    """The exercise's rule (a new bucket when the next gradient would pass the cap) and DDP's (a bucket closes once
    it reaches or passes the cap), on the toy model's gradients in reverse registration order."""
    sizes = [20, 320, 64, 1024, 64, 640]
    assert my_ddp.fill_at_most(sizes, 900) == [404, 1024, 704]
    assert my_ddp.fill_reaching(sizes, 900) == [1428, 704]
    assert my_ddp.fill_at_most(sizes, 2**20) == my_ddp.fill_reaching(sizes, 2**20) == [2132]
    # notebook 11's caps: DDP's rule gives 1 and 2 buckets, BucketDDP's 2 and 3
    assert my_ddp.fill_reaching(sizes, 1500) == [2132] and my_ddp.fill_reaching(sizes, 1100) == [1428, 704]
    assert my_ddp.fill_at_most(sizes, 1500) == [1492, 640]
    assert my_ddp.fill_at_most(sizes, 1100) == [404, 1088, 640]
    assert my_ddp.fill_at_most([2000, 10], 1000) == [2000, 10]  # one gradient alone past the cap
    for cap in my_ddp.CAPS[1:]:  # the small caps: never one bucket, never one per parameter, whatever the order
        assert all(1 < len(layout) < len(sizes) for layout in my_ddp.layouts(sizes, cap))
