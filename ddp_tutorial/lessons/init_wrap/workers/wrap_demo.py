"""Step 2 up close, on CPU and gloo: the ``broadcast`` at ``DDP(model)``, the averaged
``gradient`` against one process on every rank's batch, and the ``buckets`` (all-reduces per
backward under each ``--bucket-caps``): a report of each ``part``.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/lessons/init_wrap/workers/wrap_demo.py
"""

import argparse
import copy
import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import train
from ddp_tutorial.rank.instrument import param_checksum
from ddp_tutorial.rank.timing import SyncTimer
from ddp_tutorial.runfolder import report


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bucket-caps", type=float, nargs="+", default=[25.0, 1.0, 0.5, 0.25, 0.1])
    p.add_argument("--iterations", type=int, default=3)  # buckets are rebuilt after the first
    return p.parse_args()


def param_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bit-identical models."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])


def rank_batch(seed: int, rank: int, batch_size: int):
    """The micro-batch of ``rank``: any rank can rebuild any other's from the seed."""
    g = torch.Generator().manual_seed(seed * 1000 + 17 + rank)
    return torch.randn(batch_size, 10, generator=g), torch.randn(batch_size, 20, generator=g)


def bucket_sizes(ddp: DDP):
    """Rebuilt bucket sizes in bytes from DDP's logging data (it stores them as "a, b, ...")."""
    text = str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", ""))
    return [int(s) for s in text.replace(",", " ").split()]


def broadcast_and_gradient(args, rank: int, world_size: int) -> None:
    torch.manual_seed(args.seed + rank)  # deliberately different on every rank
    model = train.Model()
    before = {"checksum": param_checksum(model), "digest": param_digest(model)}
    ddp = DDP(model)  # broadcasts rank 0's parameters (and buffers) to every rank
    report({"part": "broadcast", "checksum_before": before["checksum"],
            "digest_before": before["digest"], "checksum_after": param_checksum(model),
            "digest_after": param_digest(model)})
    print(f"rank {rank}: parameter checksum {before['checksum']:.6f} before DDP(model), "
          f"{param_checksum(model):.6f} after", flush=True)

    reference = copy.deepcopy(ddp.module)  # a plain model with the broadcast weights
    loss_fn = nn.MSELoss()
    x, y = rank_batch(args.seed, rank, args.batch_size)
    loss_fn(ddp(x), y).backward()  # DDP averages the gradient over ranks in here
    ddp_grad = flat_grad(ddp.module)
    record = {"part": "gradient", "grad_checksum": float(ddp_grad.double().sum())}
    if rank == 0:
        # One process, the whole global batch: the mean loss over all W*b samples.
        batches = [rank_batch(args.seed, r, args.batch_size) for r in range(world_size)]
        xs, ys = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss_fn(reference(xs), ys).backward()
        single_grad = flat_grad(reference)
        reference.zero_grad()
        loss_fn(reference(x), y).backward()  # rank 0's own micro-batch only, no averaging
        local_grad = flat_grad(reference)
        close = torch.allclose(ddp_grad, single_grad, rtol=1e-5, atol=1e-6)
        record.update({"max_abs_diff": float((ddp_grad - single_grad).abs().max()),
                       "local_max_abs_diff": float((local_grad - single_grad).abs().max()),
                       "allclose": bool(close)})
        print(f"rank 0: max |DDP grad - single-process grad| = {record['max_abs_diff']:.2e}; "
              f"local-only grad differs by {record['local_max_abs_diff']:.2e}", flush=True)
    report(record)


def deep_model(width: int = 256, depth: int = 8) -> nn.Module:
    """A stack of Linear layers, ~2 MB of fp32 parameters: enough for several buckets."""
    layers = [nn.Linear(10, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 20))


def count_allreduces(model: nn.Module, bucket_cap_mb, args, rank: int) -> dict:
    """Wrap ``model`` with ``bucket_cap_mb`` (None: DDP's default); all-reduces per backward."""
    torch.manual_seed(args.seed)
    # bucket_cap_mb=None is DDP's own default, which is not the same as 25: the first
    # bucket is then capped at dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), the rest at 25 MiB.
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    timer = SyncTimer()
    ddp.register_comm_hook(timer, SyncTimer.hook)
    x, y = rank_batch(args.seed, rank, args.batch_size)
    calls = []
    for _ in range(args.iterations):
        timer.start_step()
        nn.functional.mse_loss(ddp(x), y).backward()  # returns after every bucket is reduced
        calls.append(timer.calls)
        ddp.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    return {"bucket_cap_mb": bucket_cap_mb, "param_bytes": params * 4,
            "allreduces_per_step": calls, "rebuilt_bucket_sizes": bucket_sizes(ddp)}


def buckets(args, rank: int) -> None:
    small = count_allreduces(train.Model(), None, args, rank)
    report({"part": "buckets", "model": "Model", **small})
    default = count_allreduces(deep_model(), None, args, rank)  # DDP(model) with no bucket_cap_mb
    report({"part": "buckets", "model": "deep, DDP default", **default})
    for cap in args.bucket_caps:
        record = count_allreduces(deep_model(), cap, args, rank)
        report({"part": "buckets", "model": "deep", **record})
        if rank == 0:
            print(f"rank 0: bucket_cap_mb={cap:g}: {len(record['rebuilt_bucket_sizes'])} buckets, "
                  f"all-reduces per backward {record['allreduces_per_step']}", flush=True)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank: ranks share a small machine's cores
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        broadcast_and_gradient(args, rank, world_size)
        buckets(args, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
