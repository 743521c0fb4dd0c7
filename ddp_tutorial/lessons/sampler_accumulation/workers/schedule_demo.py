"""Which micro-batches reach an optimizer step under a step schedule, measured exactly.

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('schedule_demo.py'), 2, ['--bug'])"

A one-weight model ``y = w * x`` in float64, wrapped in DDP. Micro-batch ``i`` of
epoch ``e`` on rank ``r`` feeds ``x = 2 ** bit(r, e, i)``, so its gradient is that
power of two and no two micro-batches share a bit. Gradients add up until
``zero_grad``, and DDP averages over ranks; multiplying the synced gradient by
the world size gives back the sum of tags, and its bits name **exactly** the
micro-batches (of every rank) that an optimizer step applied. What is left in
``.grad`` after the last epoch was never applied.

The loop is the kit's step 4 with the schedule of ``train.sync_schedule`` (or, with
``--bug``, ``original.sync_schedule``): the micro-batches that do not sync run
forward and backward inside ``no_sync()``.
Rank 0 reports ``steps`` (one entry per optimizer step: epoch, micro-batch,
and the ``[rank, epoch, micro]`` it applied) and ``lost`` (per rank, never applied).

Flags:
    --bug            the original schedule: sync when ``i % K == 0``
    --micro N        micro-batches per epoch (default 6)
    --accum-steps K  (default 4)
    --epochs E       (default 2)
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bug", action="store_true")
    p.add_argument("--micro", type=int, default=6)
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = DDP(nn.Linear(1, 1, bias=False).double())
        weight = model.module.weight
        steps = []
        for epoch in range(args.epochs):
            plan = (original if args.bug else train).sync_schedule(args.micro, args.accum_steps)
            for micro, sync in enumerate(plan):
                x = torch.tensor([[2.0 ** bit(rank, epoch, micro, world_size, args.micro)]], dtype=torch.float64)
                with contextlib.nullcontext() if sync else model.no_sync():
                    model(x).sum().backward()  # d/dw (w * x) = x: this micro-batch's tag
                if sync:  # DDP averaged over ranks: times world_size is the sum of the tags
                    steps.append({"epoch": epoch, "micro": micro,
                                  "applied": decode(weight.grad.item() * world_size, world_size, args.micro)})
                    model.zero_grad(set_to_none=True)  # the optimizer step would go here
        left = weight.grad.item() if weight.grad is not None else 0.0  # local: never all-reduced
        lost = [None] * world_size
        dist.all_gather_object(lost, decode(left, world_size, args.micro))
        if rank == 0:
            report({"steps": steps, "lost": lost, "bug": args.bug, "micro_per_epoch": args.micro,
                    "accum_steps": args.accum_steps, "epochs": args.epochs, "world_size": world_size})
            for s in steps:
                print(f"step after epoch {s['epoch']} micro {s['micro']}: applied "
                      f"{len(s['applied'])} micro-batches", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
