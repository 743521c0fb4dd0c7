"""Pitfall 5: which seeds must match across ranks, and which must differ.

Parts, each with ``seed`` on every rank and with ``seed + rank``: ``init`` (a fresh model's
digest), ``sampler`` (one epoch's indices), ``dropout`` (a DDP model's masks per step).
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import digest, flags, reporter, run

report = reporter("seeding")

D_IN = 32  # 2**32 possible masks per sample: two equal masks are no accident


def make_model() -> nn.Module:
    return nn.Sequential(nn.Dropout(0.5), nn.Linear(D_IN, 1))


def seeded_setup(seed: int, rank: int, dataset_size: int):
    """The right recipe, in order: one seed for the model and the sampler, then one per rank."""
    torch.manual_seed(seed)  # 1. the same initial model on every rank
    model = DDP(make_model())
    sampler = DistributedSampler(range(dataset_size), shuffle=True, seed=seed)  # 2. one permutation, split
    torch.manual_seed(seed + rank)  # 3. dropout and augmentation: each rank its own random stream
    return model, sampler


def dropout_masks(model: DDP, steps: int, batch_size: int):
    """Per step, one 0/1 string per sample: which inputs dropout kept."""
    masks = []

    def record(module, inputs, out):
        masks.append(["".join("1" if v else "0" for v in row) for row in (out != 0).tolist()])

    handle = model.module[0].register_forward_hook(record)
    for _ in range(steps):
        x = torch.randn(batch_size, D_IN).abs() + 0.1  # never 0: a 0 in the output means dropped
        model(x).sum().backward()
    handle.remove()
    return masks


def parser():
    return flags(__doc__, dataset_size=16, batch_size=4, steps=3)


def body(args, rank: int, world_size: int) -> None:
    torch.manual_seed(args.seed)
    same = digest(make_model().parameters())
    torch.manual_seed(args.seed + rank)
    report({"part": "init", "same_seed": same, "per_rank_seed": digest(make_model().parameters())})

    model, sampler = seeded_setup(args.seed, rank, args.dataset_size)
    wrong = DistributedSampler(range(args.dataset_size), shuffle=True, seed=args.seed + rank)
    report({"part": "sampler", "dataset_size": args.dataset_size, "same_seed": list(sampler),
            "per_rank_seed": list(wrong)})
    per_rank = dropout_masks(model, args.steps, args.batch_size)

    torch.manual_seed(args.seed)  # one seed, set alike on every rank, and nothing after it
    same_masks = dropout_masks(DDP(make_model()), args.steps, args.batch_size)
    report({"part": "dropout", "same_seed": same_masks, "per_rank_seed": per_rank})


if __name__ == "__main__":
    run(body, parser())
