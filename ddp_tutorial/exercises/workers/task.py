"""The exercises' fixed task: one tiny seeded model, one seeded dataset, the loss and the settings.

Every skeleton imports it, so a check knows what a correct script computes (``reference``). It
draws nothing from torch's global random state: every rank builds the same model and data.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddp_tutorial import envvars
from ddp_tutorial.exercises.settings import (  # noqa: F401 (the scripts read them as task.*)
    ACCUM_STEPS, BATCH_SIZE, DATASET_SIZE, EPOCHS, FAIL_AT_CALL, LR, SEED)

IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 8, 2


class InjectedFailure(RuntimeError):
    """The error ``loss_fn`` raises on purpose on the rank named by DDP_EXERCISE_FAIL_RANK."""


def make_model(seed: int = SEED) -> nn.Module:
    """The MLP 4 -> 8 -> 2, its weights drawn from ``seed`` (the same seed gives the same model)."""
    model = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))
    weights = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=weights) * 0.5)
    return model


def make_dataset(seed: int = SEED, size: int = DATASET_SIZE) -> TensorDataset:
    """``size`` inputs and the targets a fixed teacher gives them, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(size, OUT_FEATURES, generator=g)
    return TensorDataset(x, y)


def local_batches(rank: int, steps: int, size: int = BATCH_SIZE):
    """``steps`` batches (x, y) that differ from rank to rank (exercise "wrap")."""
    data = make_dataset(seed=SEED + 1000 + rank, size=steps * size)
    return [data[i * size:(i + 1) * size] for i in range(steps)]


def make_optimizer(params) -> torch.optim.Optimizer:
    """Plain SGD with the task's learning rate."""
    return torch.optim.SGD(params, lr=LR)


_loss_calls = 0


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error. Raises ``InjectedFailure`` when a check asked this rank to fail."""
    global _loss_calls
    _loss_calls += 1
    fail_rank = os.environ.get(envvars.EXERCISE_FAIL_RANK)
    if fail_rank is not None and fail_rank == os.environ.get("RANK") and _loss_calls == FAIL_AT_CALL:
        from ddp_tutorial.runfolder import report  # only here: a plain run needs no run folder

        report({"event": "injected_failure", "call": _loss_calls})  # ordered against destroy
        raise InjectedFailure(f"rank {fail_rank} fails on purpose in micro-step {FAIL_AT_CALL} "
                              "(the check's test of what a failing rank leaves behind)")
    return F.mse_loss(output, target)


def checkpoint_path() -> str:
    """Where the capstone saves its model: in the check's run folder, else the current folder."""
    return os.path.join(os.environ.get(envvars.EXERCISE_OUT) or ".", "capstone_model.pt")
