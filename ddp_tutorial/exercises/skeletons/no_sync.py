"""Exercise "no_sync": accumulate gradients over K micro-batches, all-reducing once per step.

The loop below steps the optimizer after every K = task.ACCUM_STEPS micro-batches,
and after the epoch's last one: 7 micro-batches per epoch make a window of 4, then
a shorter one of 3 (the epoch's tail), so no gradient is left in .grad for the next
epoch. Make it do what one process would do on one batch as large as each window,
with a single gradient all-reduce per optimizer step. Then:

    exercises.check("no_sync")
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

K = task.ACCUM_STEPS

dist.init_process_group("gloo")
try:
    model = DDP(task.make_model())
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
    n = len(loader)  # micro-batches per epoch

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            window = min(K, n - (i - i % K))  # this window's size: K, or what is left of the epoch
            last_of_window = (i + 1) % K == 0 or i == n - 1  # the epoch's tail ends a window too

            # TODO 1: on all but the last micro-batch of a window, skip the gradient all-reduce
            #         (model.no_sync()); the last one's backward then syncs the window's sum.
            # TODO 2: make the window's gradients add up to the mean over its micro-batches.
            loss = task.loss_fn(model(x), y)
            loss.backward()

            if last_of_window:
                optimizer.step()
                optimizer.zero_grad()
finally:
    model = None  # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
    dist.destroy_process_group()
