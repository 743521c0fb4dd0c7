"""Exercise "wrap": wrap the model in DistributedDataParallel.

Each rank starts from different weights and trains on different data, on
purpose. Once the model is wrapped, every rank should hold the same parameters
right after wrapping and after every optimizer step. Then, in the notebook:

    exercises.check("wrap")
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: F401 (you will need it)

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = task.make_model(seed=rank)  # different weights on every rank

    # TODO: wrap the model in DDP, and train the wrapped model below.

    optimizer = task.make_optimizer(model.parameters())
    for x, y in task.local_batches(rank, steps=3):  # different data on every rank
        optimizer.zero_grad()
        loss = task.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"rank {rank}: final loss {loss.item():.4f}")
finally:
    model = None  # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
    dist.destroy_process_group()
