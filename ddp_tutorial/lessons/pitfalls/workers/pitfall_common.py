"""What the pitfall scripts (``pitfall_*.py``) share: the group's life, seeded data, digests.

Each script defines ``parser()`` and ``body(args, rank, world_size)``, reports each part with
``reporter(name)`` and ends with ``run(body, parser())``; ``pitfall_lab.py`` runs the
``body`` of several scripts in one process group. Alone, pitfall ``<name>`` runs as

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/lessons/pitfalls/workers/pitfall_<name>.py
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from ddp_tutorial import runfolder


def run(body: Callable, parser: argparse.ArgumentParser) -> None:
    """Parse the flags (and ``--pg-timeout``), join the group (nccl with ``--device cuda``), run
    ``body(args, rank, world_size)``, always leave the group."""
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="seconds a collective may wait for the other ranks")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit(f"{parser.prog}: start me with ddp_tutorial.launch or torchrun "
                         "(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set)")
    torch.set_num_threads(1)  # ranks share a small machine's cores
    backend = "nccl" if getattr(args, "device", "cpu") == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A short timeout turns a lost rank into an error instead of a 30-minute wait.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    try:
        body(args, dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def reporter(pitfall: str) -> Callable[[dict], None]:
    """``runfolder.report`` for one pitfall's script: every record also names the pitfall."""
    def report(record: dict) -> None:
        runfolder.report({"pitfall": pitfall, **record})

    return report


def flags(doc: str, **defaults) -> argparse.ArgumentParser:
    """A parser: ``--seed`` (0) and one flag per keyword (``batch_size=8``: ``--batch-size``)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in {"seed": 0, **defaults}.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=f"default: {default}")
    return p


def mlp(seed: int, d_in: int, hidden: int) -> torch.nn.Module:
    """d_in -> hidden -> tanh -> 1, seeded: the same init on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


def generator(seed: int, step: int = 0) -> torch.Generator:
    """A generator for (seed, step): any rank can redraw any batch."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def regression_batch(seed: int, step: int, rows: int, d_in: int):
    """``rows`` inputs and targets of a fixed nonlinear teacher, the same on every rank."""
    g = generator(seed, step)
    x = torch.randn(rows, d_in, generator=g) * 1.5 + 0.5  # off-centre: BatchNorm has work to do
    w = torch.randn(d_in, 1, generator=generator(seed, -1))  # the teacher: one for every step
    y = torch.tanh(x @ w) + 0.1 * torch.randn(rows, 1, generator=g)
    return x, y


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous rows of a global batch (rows divisible by ``world_size``)."""
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank:(rank + 1) * per_rank]


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between matching tensors of two sequences."""
    return max(float((x.detach().cpu().double() - y.detach().cpu().double()).abs().max())
               for x, y in zip(a, b))


def first_line(err: BaseException) -> str:
    """The first line of an exception's message: what a learner reads first."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
