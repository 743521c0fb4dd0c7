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

from ddp_tutorial.exercises import task


def flat_parameters(params) -> List[float]:
    """All parameter values in order, as one list of floats (JSON-ready)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in params]).tolist()


def global_batches(dataset, world_size: int, epoch: int, sampler_seed: int) -> List[List[int]]:
    """The indices of each optimizer step's global batch: every rank's K micro-batches together.

    Rank r reads ``DistributedSampler(..., rank=r)``'s order in micro-batches of
    BATCH_SIZE; optimizer step j takes micro-batches jK .. jK+K-1 of every rank.
    """
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=sampler_seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    window = task.BATCH_SIZE * task.ACCUM_STEPS
    return [[i for shard in shards for i in shard[start:start + window]]
            for start in range(0, len(shards[0]), window)]


def train_one_process(world_size: int, sampler_seed: int = 0, loss_scale: float = 1.0,
                      set_epoch: bool = True) -> List[float]:
    """Final parameters of one process stepping once per global batch of K * W * BATCH_SIZE samples.

    With equal micro-batches, the mean loss over a global batch has the gradient
    that DDP's averaged, K-accumulated gradients add up to when each micro-batch's
    loss is divided by K.

    Args:
        world_size: W of the DDP run this stands for.
        sampler_seed: the ``seed`` the run's DistributedSampler used.
        loss_scale: K stands for "the loss was not divided by K".
        set_epoch: False stands for "every epoch reused epoch 0's order".
    """
    model = task.make_model()
    optimizer = task.make_optimizer(model.parameters())
    dataset = task.make_dataset()
    x_all, y_all = dataset.tensors
    for epoch in range(task.EPOCHS):
        for batch in global_batches(dataset, world_size, epoch if set_epoch else 0, sampler_seed):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x_all[batch]), y_all[batch]) * loss_scale
            loss.backward()
            optimizer.step()
    return flat_parameters(model.parameters())


def references(world_size: int, sampler_seed: int = 0) -> dict:
    """The correct result and the typical mistakes' results, by name."""
    return {
        "correct": train_one_process(world_size, sampler_seed),
        "loss not divided by K": train_one_process(world_size, sampler_seed, loss_scale=task.ACCUM_STEPS),
        "no set_epoch": train_one_process(world_size, sampler_seed, set_epoch=False),
    }
