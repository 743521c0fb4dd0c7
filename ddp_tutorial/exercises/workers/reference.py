"""What a correct DDP script computes, computed in one process; and what typical mistakes compute.

The harness runs these on rank 0 after the learner's script, so a check can say
not only "the parameters differ" but "they match a run whose loss was not
divided by K". Runs in the ranks (imports torch).
"""

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
    """Micro-batch i of the epoch on every rank together: the indices of "global micro-batch" i.

    Rank r reads ``DistributedSampler(..., rank=r)``'s order in micro-batches of BATCH_SIZE.
    """
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=sampler_seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    size = task.BATCH_SIZE
    return [[i for shard in shards for i in shard[start:start + size]] for start in range(0, len(shards[0]), size)]


def train_one_process(world_size: int, sampler_seed: int = 0, divide_by: str = "window",
                      tail: str = "own window", set_epoch: bool = True) -> List[float]:
    """Final parameters of one process that applies what W ranks' averaged, accumulated gradients add up to.

    DDP averages the ranks' gradients; with equal micro-batches, the average of the
    ranks' micro-batch i is the mean loss over global micro-batch i. So one process
    that backwards each global micro-batch's mean loss, divided as the script divides
    it, and steps where the script steps, ends with the script's parameters.

    Args:
        world_size: W of the DDP run this stands for.
        sampler_seed: the ``seed`` the run's DistributedSampler used.
        divide_by: "window" (right: each loss over the size of its window, K or the
            shorter last one), "K" (the last, shorter window's loss over K too), or "1" (not divided).
        tail: "own window" (right: a step after the epoch's last micro-batch too) or
            "left in .grad" (a step only after every K-th micro-batch: the epoch's
            tail stays in .grad and joins the next epoch's first step).
        set_epoch: False stands for "every epoch reused epoch 0's order".
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
            **{name: train_one_process(world_size, sampler_seed, **kwargs) for name, kwargs in MISTAKES.items()}}
