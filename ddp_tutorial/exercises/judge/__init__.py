"""Judge an exercise from what the harness measured: one ``Criterion`` per thing a correct script does.

Every criterion is decided from the ranks' records alone (counts, parameters,
sampler orders, calls seen), never from the learner's source. A failed one
says what was measured and, where the measurement matches a typical mistake,
names it. ``common`` holds what every exercise shares; the other modules judge
one or two exercises each (``judge_init`` ... ``judge_my_ddp``), and the table
``exercises.EXERCISES`` says which judge each exercise has. No torch in here.
"""

# What the exercises and the tests use, as ``judge.NAME``; every criterion's name is in ``common``.
from ddp_tutorial.exercises.judge.common import (  # noqa: F401
    ALL_REDUCE_SUM, NOT_MEASURED, TEARDOWN_RULE, Criterion)
from ddp_tutorial.exercises.judge.init_wrap import judge_init, judge_wrap  # noqa: F401
from ddp_tutorial.exercises.judge.sampler_no_sync import judge_no_sync, judge_sampler  # noqa: F401
from ddp_tutorial.exercises.judge.teardown_capstone import judge_capstone, judge_teardown  # noqa: F401
