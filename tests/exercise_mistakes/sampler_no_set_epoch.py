"""Wrong answer to "sampler": a DistributedSampler, but no set_epoch: every epoch repeats epoch 0."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    rank = dist.get_rank()
    dataset = task.make_dataset()
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=DistributedSampler(dataset))
    for epoch in range(task.EPOCHS):
        seen = sum(len(x) for x, y in loader)
        # Summed over the ranks (an all-reduce): the whole dataset once, if the shards are right. A
        # collective also holds each rank here until every rank has joined the group, which
        # init_process_group alone does not: it waits for no one.
        together = torch.tensor(seen)
        dist.all_reduce(together)
        print(f"rank {rank}, epoch {epoch}: read {seen} of {len(dataset)} samples, {together.item()} together")
finally:
    dist.destroy_process_group()
