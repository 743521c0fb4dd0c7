"""Wrong answer to "sampler" that crashes before its loop: a typo'd keyword to DistributedSampler."""

import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset, shufle=True)  # TypeError: no keyword `shufle`
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        seen = sum(len(x) for x, y in loader)
finally:
    dist.destroy_process_group()
