"""Which micro-batches reach an optimizer step under ``original.sync_schedule``, then
``train.sync_schedule``, measured exactly: a one-weight model ``y = w * x`` in float64 under DDP,
where micro-batch ``i`` of epoch ``e`` on rank ``r`` feeds ``x = 2 ** bit(r, e, i)``, so the bits
of a synced gradient times the world size name the micro-batches a step applied.

    torchrun --standalone --nproc-per-node 2 \
        ddp_tutorial/lessons/sampler_accumulation/workers/schedule_demo.py
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import run
from ddp_tutorial.runfolder import report
from ddp_tutorial import train
from ddp_tutorial.rank import original


def bit(rank: int, epoch: int, micro: int, world_size: int, micro_per_epoch: int) -> int:
    return (epoch * micro_per_epoch + micro) * world_size + rank


def decode(total: float, world_size: int, micro_per_epoch: int):
    """The ``[rank, epoch, micro]`` whose tags sum to ``total``."""
    value, found, b = int(round(total)), [], 0
    while value:
        if value & 1:
            position, rank = divmod(b, world_size)
            epoch, micro = divmod(position, micro_per_epoch)
            found.append([rank, epoch, micro])
        value >>= 1
        b += 1
    return found


def applied_per_step(model, schedule, rank: int, world_size: int, args):
    """Train under ``schedule``: per optimizer step the ``[rank, epoch, micro]`` it applied, and
    per rank those never applied."""
    weight, steps = model.module.weight, []
    for epoch in range(args.epochs):
        for micro, sync in enumerate(schedule(args.micro, args.accum_steps)):
            tag = 2.0 ** bit(rank, epoch, micro, world_size, args.micro)
            x = torch.tensor([[tag]], dtype=torch.float64)
            with contextlib.nullcontext() if sync else model.no_sync():
                model(x).sum().backward()  # d/dw (w * x) = x: this micro-batch's tag
            if sync:  # DDP averaged over ranks: times world_size is the sum of the tags
                applied = decode(weight.grad.item() * world_size, world_size, args.micro)
                steps.append({"epoch": epoch, "micro": micro, "applied": applied})
                model.zero_grad(set_to_none=True)  # the optimizer step would go here
    left = weight.grad.item() if weight.grad is not None else 0.0  # local: never all-reduced
    lost = [None] * world_size
    dist.all_gather_object(lost, decode(left, world_size, args.micro), group=model.process_group)
    return steps, lost


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro", type=int, default=6)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    return p


def measure(args, rank: int, world_size: int, group=None) -> None:
    """Each schedule on a fresh model; rank 0 reports its ``steps`` and micro-batches ``lost``."""
    for name, schedule in (("original", original.sync_schedule), ("fixed", train.sync_schedule)):
        model = DDP(nn.Linear(1, 1, bias=False).double(), process_group=group)
        steps, lost = applied_per_step(model, schedule, rank, world_size, args)
        if rank == 0:
            report({"schedule": name, "steps": steps, "lost": lost})
            for s in steps:
                print(f"{name}: step after epoch {s['epoch']} micro {s['micro']}: applied "
                      f"{len(s['applied'])} micro-batches", flush=True)


if __name__ == "__main__":
    run(measure, parser())
