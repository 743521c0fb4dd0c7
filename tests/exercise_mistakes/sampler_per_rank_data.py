"""Wrong answer to "sampler": synthetic data drawn on each rank without a shared seed."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    dataset = TensorDataset(torch.randn(task.DATASET_SIZE, 4), torch.randn(task.DATASET_SIZE, 2))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        seen = sum(len(x) for x, y in loader)
finally:
    dist.destroy_process_group()
