"""Wrong answer to "sampler": synthetic data drawn on each rank without a shared seed."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    rank = dist.get_rank()
    dataset = TensorDataset(torch.randn(task.DATASET_SIZE, 4), torch.randn(task.DATASET_SIZE, 2))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        seen = sum(len(x) for x, y in loader)
        # Summed over the ranks (an all-reduce): the whole dataset once, if the shards are right. A
        # collective also holds each rank here until every rank has joined the group, which
        # init_process_group alone does not: it waits for no one.
        together = torch.tensor(seen)
        dist.all_reduce(together)
        print(f"rank {rank}, epoch {epoch}: read {seen} of {len(dataset)} samples, {together.item()} together")
finally:
    dist.destroy_process_group()
