"""Pitfall 6: more ranks, a larger global batch: the learning rate must follow.

The global batch is W*b (K = 1). Every rank trains two DDP models on the same data: ``kept``
(one process's ``--lr``) and ``scaled`` (``W * lr`` after a linear warm-up, Goyal et al. 2017).
Rank 0 also trains one process on the same sample order and reports (``curves``) each model's
loss on the whole set after every DDP step, against samples seen.
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    flags, mlp, regression_batch, reporter, run)

report = reporter("lr")

D_IN = 8


def scaled_lr(base_lr: float, world_size: int, step: int, warmup_steps: int) -> float:
    """Linear scaling with warm-up: ``base_lr`` to ``world_size * base_lr`` over ``warmup_steps``."""
    if warmup_steps <= 0:
        return world_size * base_lr
    return base_lr * (1 + (world_size - 1) * min(1.0, step / warmup_steps))


def full_loss(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def sgd_step(model, opt, lr: float, x, y) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def parser():
    return flags(__doc__, lr=0.1, batch_size=8, dataset_size=512, epochs=3, warmup_steps=8)


def body(args, rank: int, world_size: int) -> None:
    x, y = regression_batch(args.seed, 0, args.dataset_size, D_IN)
    models = {"kept": DDP(mlp(args.seed, D_IN, 32)), "scaled": DDP(mlp(args.seed, D_IN, 32))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    sampler = DistributedSampler(range(args.dataset_size), seed=args.seed)
    single = mlp(args.seed, D_IN, 32)  # W = 1 (rank 0 only)
    single_opt = torch.optim.SGD(single.parameters(), lr=args.lr)
    single_sampler = DistributedSampler(range(args.dataset_size), num_replicas=1, rank=0, seed=args.seed)
    b = args.batch_size
    curves = {"samples": [], "single": [], "kept": [], "scaled": []}
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        single_sampler.set_epoch(epoch)
        mine, everything = list(sampler), list(single_sampler)
        for k in range(len(mine) // b):
            idx = mine[k * b:(k + 1) * b]
            sgd_step(models["kept"], opts["kept"], args.lr, x[idx], y[idx])
            sgd_step(models["scaled"], opts["scaled"], scaled_lr(args.lr, world_size, step, args.warmup_steps),
                     x[idx], y[idx])
            step += 1
            if rank == 0:  # the ranks' samples of this step, in one process: W steps of b
                start = k * world_size * b
                for j in range(start, start + world_size * b, b):
                    sgd_step(single, single_opt, args.lr, x[everything[j:j + b]], y[everything[j:j + b]])
                curves["samples"].append(step * world_size * b)
                curves["single"].append(full_loss(single, x, y))
                for name, model in models.items():
                    curves[name].append(full_loss(model.module, x, y))
    if rank == 0:
        report({"part": "curves", "world_size": world_size, "batch_size": b, "lr": args.lr,
                "scaled_lr": scaled_lr(args.lr, world_size, step, args.warmup_steps),
                "warmup_steps": args.warmup_steps, **curves})


if __name__ == "__main__":
    run(body, parser())
