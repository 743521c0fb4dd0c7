"""Judge an exercise from the ranks' records alone, never its source: one ``Criterion`` per thing a
correct script does; a failed one says what was measured and names the typical mistake it matches.
``common`` holds what every exercise shares. No torch in here.
"""

# What the exercises and the tests use, as ``judge.NAME``; every criterion's name is in ``common``.
from ddp_tutorial.exercises.judge.common import (  # noqa: F401
    ALL_REDUCE_SUM, NOT_MEASURED, TEARDOWN_RULE, Criterion)
from ddp_tutorial.exercises.judge.init_wrap import judge_init, judge_wrap  # noqa: F401
from ddp_tutorial.exercises.judge.sampler_no_sync import judge_no_sync, judge_sampler  # noqa: F401
from ddp_tutorial.exercises.judge.teardown_capstone import judge_capstone, judge_teardown  # noqa: F401
