"""Pitfall 4: validation accuracy over DistributedSampler's padded shards.

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/lessons/pitfalls/workers/pitfall_evaluation.py

A fixed classifier on validation sets of each ``--sizes``; the sampler pads uneven shards with
repeats. Per size every rank reports its shard and accuracy, and three all-reduced answers:
``mean_of_means``, ``padded_counts`` (every slot) and ``real_counts`` (the fix); rank 0 also
``true``, one process on the whole set.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import flags, generator, reporter, run

report = reporter("evaluation")

D_IN, CLASSES = 8, 3


def parser() -> argparse.ArgumentParser:
    p = flags(__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[10])
    return p


def validation_set(size: int, seed: int, model: nn.Module):
    """Inputs and labels; the labels agree with the model on about 60 % of the samples."""
    g = generator(seed, size)
    x = torch.randn(size, D_IN, generator=g)
    with torch.no_grad():
        noisy = model(x) + 1.5 * torch.randn(size, CLASSES, generator=g)
    return x, noisy.argmax(1)


def evaluate(model, x, labels, indices):
    """Per index, 1 if the model's prediction is right."""
    with torch.no_grad():
        return (model(x[indices]).argmax(1) == labels[indices]).long()


def body(args, rank: int, world_size: int) -> None:
    torch.manual_seed(args.seed)
    model = nn.Linear(D_IN, CLASSES).eval()  # the same classifier on every rank
    for size in args.sizes:
        x, labels = validation_set(size, args.seed, model)
        sampler = DistributedSampler(range(size), shuffle=False)  # the usual validation sampler
        indices = list(sampler)
        correct = evaluate(model, x, labels, indices)
        # Shard position i of rank r is position r + i * world_size of the padded list;
        # positions from ``size`` on are the padding (repeats of the first samples).
        real = torch.tensor([rank + i * world_size < size for i in range(len(indices))])
        own = correct.double().mean()
        mean_of_means = own.clone()
        dist.all_reduce(mean_of_means)
        padded = torch.tensor([correct.sum(), len(indices)], dtype=torch.long)
        dist.all_reduce(padded)
        fixed = torch.tensor([correct[real].sum(), real.sum()], dtype=torch.long)
        dist.all_reduce(fixed)  # sums of exact counts: the same on every rank, in any order
        record = {"part": "eval", "size": size, "indices": indices, "padded": (~real).tolist(),
                  "own_accuracy": float(own), "mean_of_means": float(mean_of_means) / world_size,
                  "padded_counts": padded.tolist(), "real_counts": fixed.tolist()}
        if rank == 0:
            everything = evaluate(model, x, labels, list(range(size)))
            record["true"] = [int(everything.sum()), size]
            print(f"size {size}: accuracy {fixed[0]}/{fixed[1]} = {float(fixed[0] / fixed[1]):.4f}", flush=True)
        report(record)


if __name__ == "__main__":
    run(body, parser())
