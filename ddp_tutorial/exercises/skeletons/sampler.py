"""Exercise "sampler": give every rank its own shard of the data, reshuffled every epoch.

Every rank builds the same dataset. Together the ranks should read each sample
once per epoch (their shards disjoint), in a new order every epoch. The loop
only reads the batches, and counts them: training would go where it counts.
Then, in the notebook:

    exercises.check("sampler")
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler  # noqa: F401 (you will need it)

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    rank = dist.get_rank()
    dataset = task.make_dataset()  # the same on every rank: built from a shared seed

    # TODO 1: give each rank its own shard: a DistributedSampler, passed to the DataLoader.
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, shuffle=True)

    for epoch in range(task.EPOCHS):
        # TODO 2: make this epoch's shuffle new, and the same on every rank.
        seen = sum(len(x) for x, y in loader)
        # Summed over the ranks (an all-reduce): the whole dataset once, if the shards are right. A
        # collective also holds each rank here until every rank has joined the group, which
        # init_process_group alone does not: it waits for no one.
        together = torch.tensor(seen)
        dist.all_reduce(together)
        print(f"rank {rank}, epoch {epoch}: read {seen} of {len(dataset)} samples, {together.item()} together")
finally:
    dist.destroy_process_group()
