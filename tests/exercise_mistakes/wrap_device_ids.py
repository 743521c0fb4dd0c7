"""Wrong answer to "wrap": GPU code copied to CPU, DDP(model, device_ids=[rank])."""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = DDP(task.make_model(seed=rank), device_ids=[rank])  # device_ids are for GPU modules
    optimizer = task.make_optimizer(model.parameters())
    for x, y in task.local_batches(rank, steps=3):
        optimizer.zero_grad()
        task.loss_fn(model(x), y).backward()
        optimizer.step()
finally:
    dist.destroy_process_group()
