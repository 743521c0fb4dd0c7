"""Wrong answer to "wrap": the model is wrapped, but forward goes through ddp_model.module."""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = DDP(task.make_model(seed=rank))
    optimizer = task.make_optimizer(model.parameters())
    for x, y in task.local_batches(rank, steps=3):
        optimizer.zero_grad()
        loss = task.loss_fn(model.module(x), y)  # bypasses DDP: backward syncs nothing
        loss.backward()
        optimizer.step()
finally:
    dist.destroy_process_group()
