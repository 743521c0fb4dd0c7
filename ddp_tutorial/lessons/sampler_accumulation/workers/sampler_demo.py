"""What DistributedSampler hands each rank: per-epoch orders, padding, and per-rank data.

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/lessons/sampler_accumulation/workers/sampler_demo.py

Flags: ``--dataset-size 24 --epochs 3 --padding-size 10 --data-size 64 --seed 0``.
Each rank reports (``run.result(rank, key)``):

- ``orders_set_epoch`` / ``orders_no_set_epoch``: per epoch, the sample indices
  its sampler yields, with and without ``sampler.set_epoch(epoch)``;
- ``padding``: for a ``--padding-size`` dataset, its indices with the default
  ``drop_last=False`` (padded with repeats) and with ``drop_last=True``;
- ``data_shared`` / ``data_per_rank``: a fingerprint of the dataset
  ``train.make_dataset`` builds on this rank, from ``train.make_inputs`` (one shared
  seed) and from ``original.make_inputs`` (the original demo's per-rank random data).
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.runfolder import report
from ddp_tutorial.rank import original
from ddp_tutorial.train import make_dataset, make_inputs


def epoch_orders(dataset_size: int, epochs: int, seed: int, set_epoch: bool):
    """This rank's indices in each epoch, calling ``set_epoch`` or not."""
    sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the shuffle seed becomes seed + epoch
        orders.append(list(sampler))
    return orders


def padded_indices(dataset_size: int, seed: int):
    """This rank's indices of a dataset the world size may not divide, both ways."""
    kept = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)
    dropped = DistributedSampler(range(dataset_size), shuffle=True, seed=seed, drop_last=True)
    return {"dataset_size": dataset_size, "drop_last_false": list(kept),
            "drop_last_true": list(dropped)}


def fingerprint(size: int, seed: int, rank: int, per_rank_bug: bool):
    """A digest and the first input row of the dataset this rank builds."""
    inputs = original.make_inputs(size, seed, rank) if per_rank_bug else make_inputs(size, seed)
    x, y = make_dataset(inputs, seed).tensors
    digest = hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:12]
    return {"digest": digest, "first_row": [round(v, 4) for v in x[0, :4].tolist()],
            "input_sum": round(float(x.sum()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset-size", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--padding-size", type=int, default=10)
    parser.add_argument("--data-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        report({
            "world_size": world_size,
            "orders_set_epoch": epoch_orders(args.dataset_size, args.epochs, args.seed, True),
            "orders_no_set_epoch": epoch_orders(args.dataset_size, args.epochs, args.seed, False),
            "padding": padded_indices(args.padding_size, args.seed),
            "data_shared": fingerprint(args.data_size, args.seed, rank, per_rank_bug=False),
            "data_per_rank": fingerprint(args.data_size, args.seed, rank, per_rank_bug=True),
        })
        dist.barrier()  # every rank has reported before any leaves
        print(f"rank {rank}/{world_size}: reported sampler orders, padding and data fingerprints",
              flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
