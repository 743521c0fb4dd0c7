"""Exercise "shard" (ZeRO-1): typical wrong answers fail on real ranks with a message that names the mistake.

The reference solution and the untouched skeleton are checked with every
other exercise in ``test_exercises.py``; these are the wrong answers, each in
``tests/exercise_mistakes/shard_<mistake>.py``, and what the judge's
measurements must say about them.
"""

import pytest

from ddp_tutorial import exercises
from ddp_tutorial.exercises import shard
from test_exercises import MISTAKES, TIMEOUT, assert_nothing_left, failed, in_tmp_folder, passed_names  # noqa: F401

# (file in exercise_mistakes/, {criterion that fails: words its message must say}, criteria still passing)
WRONG_ANSWERS = [
    # ZeRO's state_dict() raises on a rank that did not consolidate: the run fails, and the check says why.
    ("shard_no_consolidate",
     {"runs to the end": ["rank 0 failed", "has not been consolidated"],
      "rank 0's checkpoint": ["without consolidate_state_dict()", "on every rank first"]},
     [shard.SHARDED, shard.SAME_AS_DDP]),
    ("shard_consolidate_rank0_only",
     {"rank 0's checkpoint": ["ran on rank 0 only, not on rank 1", "it is a collective"]},
     [shard.SHARDED]),
    ("shard_default_lr",
     {"final parameters equal the DDP script's": ["learning rate is 0.001", "Adam's default", "used 0.01"]},
     [shard.SHARDED, shard.CHECKPOINT]),
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
    assert_nothing_left(result, tmp_path)


def test_the_solution_holds_an_uneven_share_and_saves_it_whole(tmp_path):
    """The measured numbers behind the ✓s: ZeRO's greedy split of the 4 -> 8 -> 2 model, 32 and 26 elements."""
    result = exercises.check("shard", exercises.SOLUTIONS_DIR / "shard.py", timeout=TIMEOUT)
    details = {name: detail for name, _, detail in result.criteria}
    assert "rank 0: 260 bytes, rank 1: 220 bytes; together 480 = one copy" in details[shard.SHARDED]
    assert "4 of 4 parameters' Adam state, 480 bytes" in details[shard.CHECKPOINT]
    assert_nothing_left(result, tmp_path)
