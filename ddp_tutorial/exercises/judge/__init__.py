"""Judge an exercise from what the harness measured: one ``Criterion`` per thing a correct script does.

Every criterion is decided from the ranks' records alone (counts, parameters,
sampler orders, calls seen), never from the learner's source. A failed one
says what was measured and, where the measurement matches a typical mistake,
names it. ``common`` holds what every exercise shares; the other modules judge
one or two exercises each (``judge_init`` ... ``judge_my_ddp``), and the table
``exercises.EXERCISES`` says which judge each exercise has. No torch in here.
"""

# The criteria's names and every exercise's judge, as ``judge.NAME`` (tests and the exercises use them).
from ddp_tutorial.exercises.judge.common import (  # noqa: F401
    ALL_REDUCE_SUM, CHECKPOINT_LOADS, CLEAN_EXIT, CLEAN_TEARDOWN, DESTROYED, FAILING_RANK_LEAVES, IN_PLACE, JOINED,
    K_MICRO_STEPS, MEETS_AT_LAUNCHER, NOT_MEASURED, NOTHING_LEFT, ONE_ALLREDUCE_PER_STEP, ONLY_RANK0_SAVES, PORT_FREE,
    RAN_TO_END, RESHUFFLED, RUNS_PLAIN, RUNS_TORCHRUN, SAME_AFTER_STEPS, SAME_AFTER_WRAP, SAME_AS_ONE_PROCESS,
    SAME_CALLS, SAME_DATASET, SHARDS, TEARDOWN_RULE, TOLERANCE, WRAPPED, Criterion)
from ddp_tutorial.exercises.judge.init_wrap import judge_init, judge_wrap  # noqa: F401
from ddp_tutorial.exercises.judge.sampler_no_sync import MISTAKE_RESULTS, judge_no_sync, judge_sampler  # noqa: F401
from ddp_tutorial.exercises.judge.teardown_capstone import judge_capstone, judge_teardown  # noqa: F401
