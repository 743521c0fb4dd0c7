"""Judge an exercise from what the harness measured: one ``Criterion`` per thing a correct script does.

Every criterion is decided from the ranks' records alone (counts, parameters,
sampler orders, calls seen), never from the learner's source. A failed one
says what was measured and, where the measurement matches a typical mistake,
names it. ``common`` holds what every exercise shares; the other modules judge
two exercises each (``judge_init`` ... ``judge_capstone``). No torch in here.
"""

from ddp_tutorial.exercises.judge.common import (
    TOLERANCE, RAN_TO_END, JOINED, MEETS_AT_LAUNCHER, ALL_REDUCE_SUM, WRAPPED, SAME_AFTER_WRAP,
    SAME_AFTER_STEPS, SAME_DATASET, SHARDS, RESHUFFLED, ONE_ALLREDUCE_PER_STEP, K_MICRO_STEPS,
    SAME_AS_ONE_PROCESS, CLEAN_EXIT, DESTROYED, NOTHING_LEFT, PORT_FREE, FAILING_RANK_LEAVES,
    ONLY_RANK0_SAVES, CLEAN_TEARDOWN, RUNS_PLAIN, RUNS_TORCHRUN, CHECKPOINT_LOADS, SAME_CALLS, Criterion,
    IN_PLACE, NOT_MEASURED, TEARDOWN_RULE)
from ddp_tutorial.exercises.judge.init_wrap import (
    judge_init, judge_wrap)
from ddp_tutorial.exercises.judge.sampler_no_sync import (
    judge_sampler, MISTAKE_RESULTS, judge_no_sync)
from ddp_tutorial.exercises.judge.teardown_capstone import (
    judge_teardown, judge_capstone)

__all__ = ["TOLERANCE", "RAN_TO_END", "JOINED", "MEETS_AT_LAUNCHER", "ALL_REDUCE_SUM", "WRAPPED",
           "SAME_AFTER_WRAP", "SAME_AFTER_STEPS", "SAME_DATASET", "SHARDS", "RESHUFFLED",
           "ONE_ALLREDUCE_PER_STEP", "K_MICRO_STEPS", "SAME_AS_ONE_PROCESS", "CLEAN_EXIT", "DESTROYED",
           "NOTHING_LEFT", "PORT_FREE", "FAILING_RANK_LEAVES", "ONLY_RANK0_SAVES", "CLEAN_TEARDOWN",
           "RUNS_PLAIN", "RUNS_TORCHRUN", "CHECKPOINT_LOADS", "SAME_CALLS", "Criterion", "IN_PLACE",
           "NOT_MEASURED", "TEARDOWN_RULE", "judge_init", "judge_wrap", "judge_sampler", "MISTAKE_RESULTS",
           "judge_no_sync", "judge_teardown", "judge_capstone"]
