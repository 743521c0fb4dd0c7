"""Wrong answer to "sampler": a DistributedSampler, but no set_epoch: every epoch repeats epoch 0."""

import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    dataset = task.make_dataset()
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=DistributedSampler(dataset))
    for epoch in range(task.EPOCHS):
        seen = sum(len(x) for x, y in loader)
finally:
    dist.destroy_process_group()
