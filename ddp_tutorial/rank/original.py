"""The original demo's code: each function is the original's version of the train.py function of
the same name, with one mistake (``ddp_tutorial.mistakes``); ``--bug NAME`` swaps it in, e.g.
``python -m ddp_tutorial.train --bug forward-outside-no-sync`` runs ``original.micro_step``."""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Iterable, List, Optional
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.mistakes import BUGS


def make_inputs(size: int, seed: int, rank: Optional[int] = None) -> torch.Tensor:
    """The original: every rank (``rank``; None: RANK's) draws its own random inputs."""
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    return torch.randn(size, 10, generator=torch.Generator().manual_seed(seed + 1000 * (rank + 1)))


def start_epoch(sampler: DistributedSampler, epoch: int) -> None:
    """The original never calls ``sampler.set_epoch(epoch)``: every epoch repeats one order."""


def sync_schedule(num_batches: int, accum_steps: int) -> List[bool]:
    """The original syncs when ``i % K == 0``: the first update follows a single micro-batch."""
    return [i % accum_steps == 0 for i in range(num_batches)]


def loss_divisors(num_batches: int, accum_steps: int) -> List[int]:
    """The original divides no loss by K: the K accumulated gradients add up to K times the mean."""
    return [1] * num_batches


def micro_step(model: nn.Module, loss_fn, x, y, loss_divisor: int, sync: bool) -> torch.Tensor:
    """The original runs forward before ``no_sync()``: DDP has already planned the all-reduce."""
    skip_sync = isinstance(model, DDP) and not sync  # a plain model has nothing to skip
    out = model(x)
    with model.no_sync() if skip_sync else contextlib.nullcontext():
        loss = loss_fn(out, y)
        (loss / loss_divisor).backward()
    return loss


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The original draws fresh random labels every step (``torch.rand_like``): nothing to learn."""
    return F.mse_loss(out, torch.rand_like(out))


@contextlib.contextmanager
def mistakes(bugs: Iterable[str], train_module: ModuleType):
    """Within the block, ``train_module`` (train.py, also as ``__main__``) calls the original's
    version of each function the ``--bug`` names in ``bugs`` replace."""
    unknown = sorted(set(bugs) - set(BUGS))
    if unknown:
        raise ValueError(f"not a --bug of train.py: {unknown}; choose from {sorted(BUGS)}")
    with contextlib.ExitStack() as stack:
        for name in (BUGS[bug] for bug in bugs):
            stack.enter_context(mock.patch.object(train_module, name, globals()[name]))
        yield
