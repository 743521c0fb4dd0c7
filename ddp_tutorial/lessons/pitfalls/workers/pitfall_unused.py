"""Pitfall 2: parameters that some steps do not use.

``Branchy``'s auxiliary head is used on even steps only (``alternate``) or never. Parts:
``error`` (plain DDP: "Expected to have finished reduction in the prior iteration", with the
parameter names in DDP's order); ``find_unused`` and ``static_graph`` (per step the parameters
without a gradient, a digest, rank 0's difference from one process); ``static_graph_error``
(static_graph on the alternating head); ``cost`` (three wrappings of one fully used model, one
step of each in turn: wall and CPU time per step).
"""

import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    digest, first_line, flags, max_diff, regression_batch, reporter, run, shard)

report = reporter("unused")

D_IN, HIDDEN = 8, 16


class Branchy(nn.Module):
    """A trunk, a head, and an auxiliary head that ``forward`` uses only when asked."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # the same init on every rank
        self.trunk = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)
        self.aux = nn.Linear(HIDDEN, 1)

    def forward(self, x, use_aux: bool):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def uses_aux(schedule: str, step: int) -> bool:
    return schedule == "alternate" and step % 2 == 0


def train_steps(model, args, rank: int, world_size: int, schedule: str, sharded: bool = True,
                without_grad=None):
    """SGD steps on the schedule; per step (into ``without_grad``, so that it says how far a
    failed run got), the names of parameters left without a gradient."""
    inner = model.module if isinstance(model, DDP) else model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    without_grad = [] if without_grad is None else without_grad
    for step in range(args.steps):
        x, y = regression_batch(args.seed, step, args.batch_size * world_size, D_IN)
        if sharded:
            x, y = shard(x, rank, world_size), shard(y, rank, world_size)
        opt.zero_grad(set_to_none=True)  # None, not zero: a skipped head must not move
        nn.functional.mse_loss(model(x, uses_aux(schedule, step)), y).backward()
        without_grad.append([n for n, p in inner.named_parameters() if p.grad is None])
        opt.step()
    return without_grad


def trained_part(part: str, ddp_kwargs: dict, schedule: str, args, rank: int, world_size: int) -> None:
    """Train with DDP(**ddp_kwargs); report what lacked gradients and how far from one process."""
    model = DDP(Branchy(args.seed), **ddp_kwargs)
    without_grad = train_steps(model, args, rank, world_size, schedule)
    record = {"part": part, "schedule": schedule, "without_grad": without_grad,
              "digest": digest(model.module.parameters())}
    if rank == 0:
        reference = Branchy(args.seed)
        train_steps(reference, args, rank, world_size, schedule, sharded=False)
        record["max_diff_reference"] = max_diff(model.module.parameters(), reference.parameters())
    report(record)


def error_part(part: str, ddp_kwargs: dict, args, rank: int, world_size: int) -> None:
    """Train on the alternating schedule until DDP refuses; report its message."""
    model = DDP(Branchy(args.seed), **ddp_kwargs)
    names = [n for n, _ in model.module.named_parameters()]
    done = []
    try:
        train_steps(model, args, rank, world_size, "alternate", without_grad=done)
    except RuntimeError as err:  # raised alike on every rank, before any collective of that step
        report({"part": part, "step": len(done), "message": str(err),
                "first_line": first_line(err), "param_names": names})
        return
    raise RuntimeError(f"{part}: DDP{ddp_kwargs} trained {args.steps} alternating steps without the error")


def deep(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(layers)])


def cost_part(args, rank: int) -> None:
    """One step of each wrapping in turn, so a slow moment of the machine hits all three alike."""
    models = {"no flag": DDP(deep(args.cost_layers)),
              "find_unused_parameters": DDP(deep(args.cost_layers), find_unused_parameters=True),
              "static_graph": DDP(deep(args.cost_layers), static_graph=True)}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    wall = {k: [] for k in models}
    cpu = {k: [] for k in models}
    for _ in range(args.cost_steps):
        for name, model in models.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            model(x).square().mean().backward()
            cpu[name].append(time.thread_time() - c0)  # this thread's CPU: not the waits for peers
            wall[name].append(time.perf_counter() - t0)
    report({"part": "cost", "layers": args.cost_layers, "wall_s": wall, "cpu_s": cpu})


def parser():
    return flags(__doc__, steps=6, batch_size=8, lr=0.1, cost_steps=60, cost_layers=32)


def body(args, rank: int, world_size: int) -> None:
    error_part("error", {}, args, rank, world_size)
    trained_part("find_unused", {"find_unused_parameters": True}, "alternate", args, rank, world_size)
    trained_part("static_graph", {"static_graph": True}, "never", args, rank, world_size)
    error_part("static_graph_error", {"static_graph": True}, args, rank, world_size)
    cost_part(args, rank)


if __name__ == "__main__":
    run(body, parser())
