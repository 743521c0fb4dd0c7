"""Pitfall 8: a collective that cannot complete, made to fail loudly and say where.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/lessons/pitfalls/workers/pitfall_hang.py \
        --case mismatch            # or: --case missing [--monitored]

Both cases fail on purpose: run them under a deadline. ``mismatch``: the last rank all-reduces
one loss more; gloo aborts in C++, and TORCH_DISTRIBUTED_DEBUG=DETAIL turns it into a
RuntimeError naming the shapes. ``missing``: the last rank never reaches a barrier that times out
after ``--wait-timeout`` s; ``--monitored`` uses ``dist.monitored_barrier``, which names the
missing rank.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import flags, reporter, run

report = reporter("hang")


def parser() -> argparse.ArgumentParser:
    p = flags(__doc__, wait_timeout=2.0)
    p.add_argument("--case", choices=["mismatch", "missing"], required=True)
    p.add_argument("--monitored", action="store_true", help="missing: use dist.monitored_barrier")
    return p


def sum_losses(rank: int, world_size: int) -> torch.Tensor:
    """All-reduce per-sample losses: 4 per rank, but 5 on the last rank (an uneven shard)."""
    losses = torch.ones(4 + (rank == world_size - 1))
    report({"part": "mismatch", "shape": list(losses.shape),
            "debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")})
    dist.all_reduce(losses)
    return losses


def wait_for_everyone(rank: int, world_size: int, monitored: bool, timeout_s: float) -> None:
    """Meet at a barrier that the last rank never reaches; it may wait ``timeout_s`` seconds."""
    # Every rank is up; from here on, collectives in `group` give up after timeout_s.
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if rank == world_size - 1:
        report({"part": "missing", "arrived": False})
        time.sleep(3600)  # stuck: this rank never reaches the barrier
    report({"part": "missing", "arrived": True, "monitored": monitored})
    if monitored:  # rank 0 waits for each rank in turn and names the ones that did not arrive
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.barrier(group=group)


def body(args, rank: int, world_size: int) -> None:
    if args.case == "mismatch":
        sum_losses(rank, world_size)
    else:
        wait_for_everyone(rank, world_size, args.monitored, args.wait_timeout)
    report({"part": args.case, "completed": True})  # never reached: the collective above fails


if __name__ == "__main__":
    run(body, parser())
