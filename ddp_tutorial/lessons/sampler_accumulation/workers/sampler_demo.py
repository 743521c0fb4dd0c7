"""What DistributedSampler hands each rank: its orders with and without ``set_epoch``, its indices
of a ``--padding-size`` dataset with ``drop_last`` False and True, and fingerprints of the dataset
built from one shared seed (``train.make_inputs``) and per rank (``original.make_inputs``).

    torchrun --standalone --nproc-per-node 4 \
        ddp_tutorial/lessons/sampler_accumulation/workers/sampler_demo.py
"""

import hashlib

import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import flags, run
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


def body(args, rank: int, world_size: int) -> None:
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


if __name__ == "__main__":
    run(body, flags(__doc__, dataset_size=24, epochs=3, padding_size=10, data_size=64))
