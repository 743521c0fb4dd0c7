"""Pitfall 1: BatchNorm under DDP. Whose statistics does each rank keep?

Linear -> BatchNorm1d -> ReLU -> Linear, the same init on every rank, ``--steps`` SGD steps on
each rank's shard. Parts: ``reference`` (rank 0: one process on each whole global batch);
``no_sync`` (buffers not synchronised); ``broadcast`` (DDP's default: rank 0's buffers at every
forward; ``forward_start_means``, ``own_ema``); ``allreduce`` (the global batch's statistics,
one all-reduce per forward); ``syncbn`` (refused on CPU: ``errors``; trains with ``--device
cuda``); ``env``. Each trained part reports ``running_mean``, ``running_var``, ``params`` and
``eval_out``.
"""

import argparse
import inspect
import os

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    first_line, flags, regression_batch, reporter, run, shard)

report = reporter("batchnorm")

D_IN, CHANNELS = 6, 4


def parser() -> argparse.ArgumentParser:
    p = flags(__doc__, steps=6, batch_size=8, lr=0.1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    return p


def global_batch_stats(x: torch.Tensor):
    """Mean, biased variance and count of ``x`` over the global batch: one all-reduce of each
    rank's (count, sum, sum of squares)."""
    local = torch.cat([x.new_tensor([x.shape[0]]), x.sum(0), (x * x).sum(0)])
    # autograd-aware: its backward all-reduces the gradient too (torch/distributed/nn/functional.py
    # _AllReduce), so every rank's loss depends on every rank's contribution
    total = dist_nn.all_reduce(local)
    channels = x.shape[1]
    count, s, sq = total[0], total[1:1 + channels], total[1 + channels:]
    mean = s / count
    return mean, sq / count - mean * mean, count


class AllReduceBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d with the global batch's statistics (what SyncBatchNorm does on GPUs)."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        mean, var, count = global_batch_stats(x)
        with torch.no_grad():  # the running statistics, updated as BatchNorm1d updates them
            self.num_batches_tracked.add_(1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * count / (count - 1))
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def make_model(seed: int, norm=nn.BatchNorm1d) -> nn.Sequential:
    torch.manual_seed(seed)  # the same init on every rank
    return nn.Sequential(nn.Linear(D_IN, CHANNELS), norm(CHANNELS), nn.ReLU(), nn.Linear(CHANNELS, 1))


def buffer_sync(flag: bool) -> dict:
    """DDP's keyword for syncing buffers at every forward: renamed in torch 2.13."""
    params = inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": flag}


def train_part(model, args, rank: int, world_size: int, device, sharded: bool = True) -> dict:
    """``--steps`` SGD steps on this rank's shard (or, not ``sharded``, the global batch); return
    the final statistics, parameters and eval outputs."""
    inner = model.module if isinstance(model, DDP) else model
    bn = inner[1]
    starts, batch_means = [], []

    def record(module, inputs):  # runs after DDP's own pre-forward, i.e. after its buffer broadcast
        starts.append(module.running_mean.tolist())
        batch_means.append(inputs[0].detach().mean(0))

    bn.register_forward_pre_hook(record)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = regression_batch(args.seed, step, args.batch_size * world_size, D_IN)
        if sharded:
            x, y = shard(x, rank, world_size), shard(y, rank, world_size)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    own_ema = torch.zeros(CHANNELS, device=device)
    for m in batch_means:  # what the running mean is if only this rank's batches count
        own_ema = (1 - bn.momentum) * own_ema + bn.momentum * m
    x_val, _ = regression_batch(args.seed, 10_000, 16, D_IN)
    inner.eval()
    with torch.no_grad():
        eval_out = inner(x_val.to(device)).flatten()
    return {"running_mean": bn.running_mean.tolist(), "running_var": bn.running_var.tolist(),
            "params": torch.cat([p.detach().flatten() for p in inner.parameters()]).tolist(),
            "eval_out": eval_out.tolist(), "forward_start_means": starts[:args.steps],
            "own_ema": own_ema.tolist()}


def body(args, rank: int, world_size: int) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    ids = [device.index] if cuda else None
    report({"part": "env", "torch": torch.__version__, "cuda_devices": torch.cuda.device_count(),
            "buffer_sync_keyword": next(iter(buffer_sync(True))), "device": args.device})
    if rank == 0:
        plain = make_model(args.seed).to(device)  # one process on the whole global batch
        report({"part": "reference",
                **train_part(plain, args, rank, world_size, device, sharded=False)})
    variants = {
        "no_sync": (make_model(args.seed), buffer_sync(False)),
        "broadcast": (make_model(args.seed), {}),  # DDP's default: rank 0's buffers, every forward
        "allreduce": (make_model(args.seed, AllReduceBatchNorm1d), {}),
    }
    for part, (model, kwargs) in variants.items():
        ddp = DDP(model.to(device), device_ids=ids, **kwargs)
        report({"part": part, **train_part(ddp, args, rank, world_size, device)})
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(make_model(args.seed)).to(device)
    if device.type == "cpu":  # torch 2.13 refuses twice: in DDP(...) and in the layer's forward
        errors = []
        for attempt in (lambda: DDP(sync), lambda: sync(torch.randn(4, D_IN))):
            try:
                attempt()
            except ValueError as err:
                errors.append(first_line(err))
        report({"part": "syncbn", "device": args.device, "errors": errors})
    else:
        ddp = DDP(sync, device_ids=ids)
        report({"part": "syncbn", "device": args.device,
                **train_part(ddp, args, rank, world_size, device)})


if __name__ == "__main__":
    run(body, parser())
