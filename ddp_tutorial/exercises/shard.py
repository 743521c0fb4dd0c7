"""What the shard exercise's script reads (``from ddp_tutorial.exercises import shard``): the
learning rate of its Adam and where rank 0 saves its checkpoint. The exercise's skeleton,
solution, harness records and judge are with notebook 10, in ``lessons/sharding/``."""

import os

from ddp_tutorial import envvars

#: The learning rate of the DDP script's Adam.
LR = 0.01


def checkpoint_path() -> str:
    """Where the script saves its checkpoint: in the check's run folder, else the current folder."""
    return os.path.join(os.environ.get(envvars.EXERCISE_OUT) or ".", "shard_checkpoint.pt")
