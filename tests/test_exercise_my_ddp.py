"""Exercise "my_ddp" (DDP built by hand): classic mistakes fail on real ranks with a message that names them,
and correct answers shaped unlike the solution pass.

The reference solution and the untouched skeleton are checked with every other exercise in
``test_exercises.py``; these are the wrong answers, each in ``tests/exercise_mistakes/my_ddp_<mistake>.py``,
and two correct ones in ``tests/scripts/my_ddp_correct_*.py``.
"""

from pathlib import Path

import pytest

from ddp_tutorial import exercises
from ddp_tutorial.exercises.judge import my_ddp
from test_exercises import MISTAKES, TIMEOUT, assert_nothing_left, failed, in_tmp_folder, passed_names  # noqa: F401

SCRIPTS = Path(__file__).resolve().parent / "scripts"

# (file in exercise_mistakes/, {criterion that fails: words its message must say}, criteria still passing)
WRONG_ANSWERS = [
    ("my_ddp_not_divided", {my_ddp.SAME: ["not dividing by W", "2.00 times DDP's"]},
     [my_ddp.BROADCAST, my_ddp.OVERLAP, my_ddp.ORDER]),
    ("my_ddp_divided_twice", {my_ddp.SAME: ["dividing twice", "0.500 times DDP's, 1/2"]},
     [my_ddp.BROADCAST, my_ddp.OVERLAP]),
    ("my_ddp_no_wait", {my_ddp.SAME: ["stepping before the handles are waited for"]}, [my_ddp.BROADCAST]),
    ("my_ddp_divide_after_launch", {my_ddp.SAME: ["a gradient changed in place after its all-reduce was launched"]},
     [my_ddp.BROADCAST, my_ddp.OVERLAP]),
    ("my_ddp_param_data", {my_ddp.SAME: ["all-reducing param.data instead of .grad"]}, [my_ddp.BROADCAST]),
    ("my_ddp_frozen_hook", {my_ddp.RAN: ["a hook on a frozen parameter", "doesn't require gradient"]}, []),
    ("my_ddp_no_broadcast", {my_ddp.BROADCAST: ["no broadcast at construction"]},
     [my_ddp.SAME, my_ddp.OVERLAP, my_ddp.NO_SYNC]),
    ("my_ddp_bucket_order", {my_ddp.ORDER: ["Buckets built in an order that differs across ranks",
                                            "sum the wrong tensors, or wait for ever"]}, [my_ddp.BROADCAST]),
    # Correct averages from blocking all-reduces after backward: one diagnosis, overlap, and no false race.
    ("my_ddp_blocking_after_backward", {my_ddp.OVERLAP: ["launched no all-reduce before backward's last gradient"]},
     [my_ddp.RAN, my_ddp.BROADCAST, my_ddp.SAME, my_ddp.NO_SYNC, my_ddp.ORDER]),
    ("my_ddp_hooks_on_a_copy", {my_ddp.SAME: ["hooks registered on another model", "none on the module it was given"]},
     [my_ddp.RAN]),
]


@pytest.mark.parametrize("mistake, failing, still_passing", WRONG_ANSWERS, ids=[w[0] for w in WRONG_ANSWERS])
def test_a_wrong_answer_fails_naming_the_mistake(mistake, failing, still_passing, tmp_path):
    result = exercises.check("my_ddp", MISTAKES / f"{mistake}.py", timeout=TIMEOUT)
    assert not result.passed
    for criterion, words in failing.items():
        detail = failed(result, criterion[:30])
        for word in words:
            assert word in detail, f"{word!r} not in {detail!r}"
    assert set(still_passing) <= passed_names(result), result.message
    assert_nothing_left(result, tmp_path)


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("my_ddp_correct_*.py")), ids=lambda p: p.stem)
def test_a_correct_answer_shaped_unlike_the_solution_passes(script, tmp_path):
    result = exercises.check("my_ddp", script, timeout=TIMEOUT)
    assert result.passed, result.message
    assert "on 2 and 4 ranks" in result.message
    assert_nothing_left(result, tmp_path)


def test_there_are_enough_wrong_and_right_answers():
    assert len(WRONG_ANSWERS) >= 5 and len(list(SCRIPTS.glob("my_ddp_correct_*.py"))) >= 2
    assert {w[0] for w in WRONG_ANSWERS} == {p.stem for p in MISTAKES.glob("my_ddp_*.py")}


def test_the_untouched_skeleton_gets_no_tick_for_an_order_it_never_showed(tmp_path):
    result = exercises.check("my_ddp", exercises.SKELETONS_DIR / "my_ddp.py", timeout=TIMEOUT)
    assert my_ddp.ORDER not in passed_names(result)  # no all-reduce launched: nothing to be in order
    assert failed(result, my_ddp.ORDER[:30]).startswith("not measured: no rank launched an all-reduce")
    assert_nothing_left(result, tmp_path)
