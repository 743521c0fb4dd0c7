"""Uneven inputs: rank r trains on ``--batches + r * --extra`` batches, with or without Join.

    torchrun --standalone --nproc-per-node 2 \
        ddp_tutorial/lessons/beyond_one_machine/workers/uneven_join.py --no-join --pg-timeout 10

Without Join the rank that runs out of data goes on to the final barrier while the others wait
in their next all-reduce until the timeout. With ``Join`` a finished rank answers those
all-reduces with zeros until every rank is done, and the ranks end with identical parameters.
Each rank writes a ``step`` record per batch and results ``reached_barrier``, ``batches``,
``params`` and ``param_checksum``.
"""

import argparse
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.runfolder import MetricsWriter, rank_run_dir


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--join", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the loop in Join([model]) (default: --join)")
    p.add_argument("--batches", type=int, default=4, help="batches of rank 0 (default: 4)")
    p.add_argument("--extra", type=int, default=2, help="more batches per higher rank (default: 2)")
    p.add_argument("--pg-timeout", type=float, default=20.0,
                   help="seconds a collective may wait before gloo raises (default: 20)")
    return p.parse_args(argv)


def train(model: nn.Module, batches: list, rank: int, metrics: MetricsWriter) -> None:
    """One optimizer step per batch; DDP all-reduces the gradients in every backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # the all-reduce: every rank must take part, or this waits
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics.write({"kind": "step", "rank": rank, "step": step, "loss": loss.item()})


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    # A short timeout: a hang becomes an error after pg_timeout s instead of gloo's 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    try:
        rank = dist.get_rank()
        run_dir = rank_run_dir(os.path.join("runs", "uneven_join"))
        metrics = MetricsWriter(run_dir, rank)
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 1))
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data...
        num_batches = args.batches + rank * args.extra  # ...and its own amount of it
        batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
                   for _ in range(num_batches)]
        # Join shadows the all-reduces of ranks that are done until every rank is done.
        with Join([model]) if args.join else contextlib.nullcontext():
            train(model, batches, rank, metrics)
        # One writer for steps and results (a second writer would truncate the file).
        metrics.write({"kind": "result", "rank": rank, "reached_barrier": True,
                       "batches": num_batches})
        print(f"rank {rank}: out of data after {num_batches} batches, waiting for the others",
              flush=True)
        dist.barrier()  # without Join, a rank with more batches never gets here
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        checksum = float(params.double().sum())
        metrics.write({"kind": "result", "rank": rank, "params": params.tolist(),
                       "param_checksum": checksum, "join": args.join})
        print(f"rank {rank}: done, parameter checksum {checksum:.6f}", flush=True)
        metrics.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
