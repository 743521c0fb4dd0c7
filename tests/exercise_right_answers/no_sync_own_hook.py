"""A right answer in another shape: registers DDP's default all-reduce as its own comm hook."""

import contextlib

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

K = task.ACCUM_STEPS

dist.init_process_group("gloo")
try:
    model = DDP(task.make_model())
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own averaging, as a hook
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    n = len(loader)  # micro-batches per epoch: 7 here, a window of K = 4, then a shorter one of 3

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            window = min(K, n - (i - i % K))  # this window's size: K, or what is left of the epoch
            last_of_window = (i + 1) % K == 0 or i == n - 1  # the epoch's tail ends a window too

            # DDP decides in forward whether the coming backward all-reduces,
            # so forward and backward both go inside no_sync().
            with contextlib.nullcontext() if last_of_window else model.no_sync():
                loss = task.loss_fn(model(x), y) / window  # the window's gradients add up to its mean's
                loss.backward()

            if last_of_window:  # nothing stays in .grad for the next epoch
                optimizer.step()
                optimizer.zero_grad()
finally:
    model = None  # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
    dist.destroy_process_group()
