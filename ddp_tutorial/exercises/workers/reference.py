"""What a correct DDP script computes, and what typical mistakes compute, in one process: a check
can say "they match a run whose loss was not divided by K". The harness runs it on rank 0."""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task


def flat_parameters(params) -> List[float]:
    """All parameter values in order, as one list of floats (JSON-ready)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in params]).tolist()


def micro_batches(dataset, world_size: int, epoch: int, sampler_seed: int) -> List[List[int]]:
    """Per micro-batch i of the epoch, the indices every rank's DistributedSampler gives it."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=sampler_seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    size = task.BATCH_SIZE
    return [[i for shard in shards for i in shard[start:start + size]]
            for start in range(0, len(shards[0]), size)]


def train_one_process(world_size: int, sampler_seed: int = 0, divide_by: str = "window",
                      tail: str = "own window", set_epoch: bool = True) -> List[float]:
    """Final parameters of one process standing for ``world_size`` DDP ranks: with equal
    micro-batches, their averaged gradient is that of the mean loss over global micro-batch i.

    The defaults are right; the mistakes: ``divide_by`` "K" (the shorter last window's loss over
    K too) or "1"; ``tail`` "left in .grad" (a step only after every K-th micro-batch);
    ``set_epoch`` False (every epoch reuses epoch 0's order).
    """
    k = task.ACCUM_STEPS
    model = task.make_model()
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    x_all, y_all = dataset.tensors
    optimizer.zero_grad()
    for epoch in range(task.EPOCHS):
        batches = micro_batches(dataset, world_size, epoch if set_epoch else 0, sampler_seed)
        n = len(batches)
        for i, batch in enumerate(batches):
            window = min(k, n - (i - i % k))  # K, or what is left of the epoch in its last window
            divisor = {"window": window, "K": k, "1": 1}[divide_by]
            (F.mse_loss(model(x_all[batch]), y_all[batch]) / divisor).backward()
            if (i + 1) % k == 0 or (tail == "own window" and i == n - 1):
                optimizer.step()
                optimizer.zero_grad()
    return flat_parameters(model.parameters())


#: The typical mistakes a check recognises by their result: name -> ``train_one_process`` arguments.
MISTAKES = {
    "loss not divided by K": {"divide_by": "1"},
    "tail left in .grad": {"divide_by": "K", "tail": "left in .grad"},
    "tail divided by K": {"divide_by": "K"},
    "no set_epoch": {"set_epoch": False},
}


def references(world_size: int, sampler_seed: int = 0) -> dict:
    """The correct result and the typical mistakes' results, by name."""
    return {"correct": train_one_process(world_size, sampler_seed),
            **{name: train_one_process(world_size, sampler_seed, **kwargs)
               for name, kwargs in MISTAKES.items()}}
