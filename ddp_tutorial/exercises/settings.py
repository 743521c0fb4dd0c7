"""The task's fixed settings (``task`` builds from them, the judge knows a correct run by them).
No torch, so the kernel reads them too."""

SEED = 0
#: 28 samples per rank on 2 ranks: 7 micro-batches of 4 per epoch, so each epoch ends with a
#: window shorter than K (4 + 3): a check sees where a script leaves that tail.
DATASET_SIZE = 56
#: Samples per micro-batch on each rank.
BATCH_SIZE = 4
#: K: micro-batches whose gradients add up before each optimizer step.
ACCUM_STEPS = 4
EPOCHS = 2
LR = 0.1

#: The rank the teardown check makes fail (through ``envvars.EXERCISE_FAIL_RANK``).
FAIL_RANK = 1
#: The call of ``task.loss_fn`` (1-based) on which that rank raises: mid-training.
FAIL_AT_CALL = 3
