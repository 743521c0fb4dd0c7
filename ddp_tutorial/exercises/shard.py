"""What the shard exercise's script reads: its Adam's learning rate and where rank 0 saves its
checkpoint. The rest of the exercise is with notebook 10, in ``lessons/sharding/``."""

import os

from ddp_tutorial import envvars

LR = 0.01


def checkpoint_path() -> str:
    """Where the script saves its checkpoint: in the check's run folder, else the current folder."""
    return os.path.join(os.environ.get(envvars.EXERCISE_OUT) or ".", "shard_checkpoint.pt")
