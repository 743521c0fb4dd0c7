"""A right answer in another shape: the optimizer is built before wrapping (the same parameter objects)."""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = task.make_model(seed=rank)  # different weights on every rank
    optimizer = task.make_optimizer(model.parameters())
    model = DDP(model)
    for x, y in task.local_batches(rank, steps=3):  # different data on every rank
        optimizer.zero_grad()
        loss = task.loss_fn(model(x), y)  # through the wrapper: that is what makes backward sync
        loss.backward()
        optimizer.step()
    print(f"rank {rank}: final loss {loss.item():.4f}")
finally:
    model = None  # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
    dist.destroy_process_group()
