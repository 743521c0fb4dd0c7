"""Wrong answer to "teardown": only rank 0 leaves the process group."""

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
    if dist.get_rank() == 0:  # as if teardown were rank 0's job, like saving
        dist.destroy_process_group()
