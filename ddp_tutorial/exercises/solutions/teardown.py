"""Exercise "teardown", solved: try/finally around the training, destroy_process_group in finally."""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
try:
    model = DDP(task.make_model())
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            task.loss_fn(model(x), y).backward()
            optimizer.step()
finally:
    # Runs on every path, an exception's too. With gloo it returns promptly even if a peer died;
    # with nccl, a collective stuck on a dead peer must be aborted first (the watchdog).
    model = None  # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
    dist.destroy_process_group()
