"""Capstone: port this single-process training script to DDP.

It trains with gradient accumulation (K = task.ACCUM_STEPS micro-batches per
optimizer step, and a shorter last window where an epoch's micro-batches are not
a multiple of K) and saves the model. Port it so that the same file runs:

  * as one plain process (`python capstone.py`, no RANK in the environment), as now;
  * under `ddp_tutorial.launch(...)` and under `torchrun --nproc-per-node 2`, where it
    must give the parameters one process gets on the global batch (K * world_size
    * task.BATCH_SIZE samples per step), with one gradient all-reduce per step,
    each rank reading its own shard, a new shuffle every epoch, the checkpoint
    written by rank 0 only, and the process group left cleanly on every rank.

Then, in the notebook:

    exercises.check("capstone")
"""

import torch
from torch.utils.data import DataLoader

from ddp_tutorial.exercises.workers import task


def main():
    K = task.ACCUM_STEPS
    model = task.make_model()
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, shuffle=True)

    n = len(loader)  # micro-batches per epoch: not always a multiple of K
    for epoch in range(task.EPOCHS):
        for i, (x, y) in enumerate(loader):
            window = min(K, n - (i - i % K))  # this window's size: K, or what is left of the epoch
            loss = task.loss_fn(model(x), y) / window  # the window's gradients add up to its mean's
            loss.backward()
            if (i + 1) % K == 0 or i == n - 1:  # the epoch's tail is a window too: nothing stays in .grad
                optimizer.step()
                optimizer.zero_grad()

    torch.save(model.state_dict(), task.checkpoint_path())
    print(f"saved {task.checkpoint_path()}")


if __name__ == "__main__":
    main()
