"""Wrong answer to the capstone, two mistakes: set_epoch is never called, and it saves the DDP
wrapper's state_dict()."""

import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task


def main():
    K = task.ACCUM_STEPS
    distributed = "RANK" in os.environ  # set by launch and torchrun; absent in a plain process
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    try:
        model = task.make_model()  # the same seed everywhere (DDP broadcasts rank 0's anyway)
        ddp_model = DDP(model) if distributed else model
        optimizer = task.make_optimizer(ddp_model.parameters())
        dataset = task.make_dataset()
        # Given num_replicas and rank, the sampler needs no process group: one plain process
        # reads the whole dataset, shuffled the same way.
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=task.SEED)
        loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)

        n = len(loader)  # this rank's micro-batches per epoch: not always a multiple of K
        for epoch in range(task.EPOCHS):
            for i, (x, y) in enumerate(loader):
                window = min(K, n - (i - i % K))  # this window's size: K, or what is left of the epoch
                last_of_window = (i + 1) % K == 0 or i == n - 1  # the epoch's tail ends a window too
                skip_sync = distributed and not last_of_window
                with ddp_model.no_sync() if skip_sync else contextlib.nullcontext():
                    loss = task.loss_fn(ddp_model(x), y) / window
                    loss.backward()  # all-reduces only at the end of a window
                if last_of_window:
                    optimizer.step()
                    optimizer.zero_grad()

        if rank == 0:  # every rank holds the same model: one writer, no race on the file
            torch.save(ddp_model.state_dict(), task.checkpoint_path())  # keys "module.0.weight", ...
            print(f"saved {task.checkpoint_path()}")
    finally:
        if distributed:
            # DDP holds the group; dropped after destroy it can deadlock gloo (torch 2.13, README)
            model = ddp_model = None
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
