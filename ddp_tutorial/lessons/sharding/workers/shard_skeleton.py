"""Exercise "shard": shard Adam's state across the ranks with ZeroRedundancyOptimizer (ZeRO-1).

This script trains with DDP and Adam, so every rank holds all of Adam's state
(two numbers per parameter). Turn it into ZeRO-1: each rank keeps the state of
its share of the parameters only. Nothing else may change: the training must
end with the same parameters, and rank 0's checkpoint must still hold the whole
optimizer state. Then, in the notebook:

    exercises.check("shard")
"""

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401 (you will need it)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises import shard
from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = DDP(task.make_model())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)

    # TODO: shard Adam's state: a ZeroRedundancyOptimizer that runs Adam with the same learning rate.
    optimizer = torch.optim.Adam(model.parameters(), lr=shard.LR)

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            task.loss_fn(model(x), y).backward()
            optimizer.step()

    # TODO: with ZeRO the state is spread over the ranks: gather it on rank 0 before saving it.
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   shard.checkpoint_path())
finally:
    dist.destroy_process_group()
