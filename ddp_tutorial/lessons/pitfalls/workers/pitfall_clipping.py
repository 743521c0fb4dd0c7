"""Pitfall 7: gradient clipping with accumulation: once, after the all-reduce.

Two DDP models, K = ``--accum-steps`` micro-steps per step (``no_sync`` on K - 1): ``right``
clips once before ``optimizer.step()``; ``wrong`` clips after every micro-step, on local
gradients. Each reports per step rank 0's ``max_diff`` from one process on the global batch
(clipped once), the ``norms`` its clips saw, and a parameter ``digest``.
"""

import contextlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    digest, flags, max_diff, mlp, regression_batch, reporter, run, shard)

report = reporter("clipping")

D_IN = 8


def micro_batch(args, step: int, micro: int, world_size: int):
    """The global micro-batch ``micro`` of optimizer step ``step`` (every rank can draw it)."""
    return regression_batch(args.seed, step * args.accum_steps + micro, args.batch_size * world_size, D_IN)


def accumulate_and_step(model: DDP, opt, args, step: int, rank: int, world_size: int,
                        clip_every_micro_step: bool):
    """One optimizer step of K micro-steps; returns the norms the clips saw (before clipping)."""
    K, norms = args.accum_steps, []
    for micro in range(K):
        x, y = micro_batch(args, step, micro, world_size)
        last = micro == K - 1
        with contextlib.nullcontext() if last else model.no_sync():  # all-reduce only on the last
            loss = nn.functional.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size))
            (loss / K).backward()
            if clip_every_micro_step:  # the mistake: a local, partial gradient inside no_sync
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)))
    if not clip_every_micro_step:  # right: once, on the averaged gradient of the global batch
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)))
    opt.step()
    opt.zero_grad()
    return norms


def reference_step(model: nn.Module, opt, args, step: int, world_size: int) -> float:
    """One plain process on the whole global batch of the step: mean loss, clip once, step."""
    batches = [micro_batch(args, step, m, world_size) for m in range(args.accum_steps)]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(model(x), y).backward()
    norm = float(nn.utils.clip_grad_norm_(model.parameters(), args.max_norm))
    opt.step()
    opt.zero_grad()
    return norm


def parser():
    return flags(__doc__, steps=4, accum_steps=4, batch_size=4, max_norm=0.1, lr=0.5)


def body(args, rank: int, world_size: int) -> None:
    variants = {"right": False, "wrong": True}
    models = {k: DDP(mlp(args.seed, D_IN, 16)) for k in variants}
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    reference = mlp(args.seed, D_IN, 16)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)
    records = {k: {"part": k, "norms": [], "max_diff": []} for k in variants}
    ref_norms = []
    for step in range(args.steps):
        for name, wrong in variants.items():
            records[name]["norms"].append(
                accumulate_and_step(models[name], opts[name], args, step, rank, world_size, wrong))
        if rank == 0:
            ref_norms.append(reference_step(reference, ref_opt, args, step, world_size))
            for name, model in models.items():
                records[name]["max_diff"].append(max_diff(model.module.parameters(), reference.parameters()))
    for name, record in records.items():
        report({**record, "digest": digest(models[name].module.parameters()), "max_norm": args.max_norm,
                **({"reference_norms": ref_norms} if rank == 0 else {})})


if __name__ == "__main__":
    run(body, parser())
