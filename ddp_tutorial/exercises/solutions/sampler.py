"""Exercise "sampler", solved: DistributedSampler shards the data, set_epoch reshuffles it."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    rank = dist.get_rank()
    dataset = task.make_dataset()  # the same on every rank: built from a shared seed

    # Rank r reads perm[r::world_size] of one permutation all ranks share.
    sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)  # no shuffle= here

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)  # the permutation comes from seed + epoch: without it, epoch 0's repeats
        seen = sum(len(x) for x, y in loader)
        # Summed over the ranks (an all-reduce): the whole dataset once, if the shards are right. A
        # collective also holds each rank here until every rank has joined the group, which
        # init_process_group alone does not: it waits for no one.
        together = torch.tensor(seen)
        dist.all_reduce(together)
        print(f"rank {rank}, epoch {epoch}: read {seen} of {len(dataset)} samples, {together.item()} together")
finally:
    dist.destroy_process_group()
