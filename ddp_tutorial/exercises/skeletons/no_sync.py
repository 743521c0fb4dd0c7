"""Exercise "no_sync": accumulate gradients over K micro-batches, all-reducing once per step.

The loop below steps the optimizer once every K = task.ACCUM_STEPS micro-batches.
Make it do what one process would do on one batch K times larger, with a single
gradient all-reduce per optimizer step. Then:

    exercises.check("no_sync")
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises import task

K = task.ACCUM_STEPS

dist.init_process_group("gloo")
try:
    model = DDP(task.make_model())
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last_of_window = (i + 1) % K == 0  # this micro-batch ends a window of K

            # TODO 1: on all but the last micro-batch of a window, skip the gradient all-reduce
            #         (model.no_sync()); the last one's backward then syncs the window's sum.
            # TODO 2: make the window's gradients add up to the mean over its K micro-batches.
            loss = task.loss_fn(model(x), y)
            loss.backward()

            if last_of_window:
                optimizer.step()
                optimizer.zero_grad()
finally:
    dist.destroy_process_group()
