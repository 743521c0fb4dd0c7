"""Train a small MLP with DistributedDataParallel: the original demo's five steps, done right.

    python -m ddp_tutorial.train                        # one plain process
    torchrun --nproc-per-node 4 -m ddp_tutorial.train   # 4 ranks, CPU (gloo) or GPUs (nccl)
    ddp_tutorial.launch(ddp_tutorial.TRAIN_SCRIPT, 4, ["--epochs", "2"])  # from a notebook

The steps: (1) ``init_process_group``, (2) ``wrap_model``, (3) ``make_loader``, ``start_epoch``,
(4) ``train_epoch`` (``micro_step`` is the ``no_sync`` window), (5) ``teardown``. What the kit
measures comes in through ``hooks`` (``rank/hooks.py``); without them this is plain DDP.
``--bug NAME`` runs the original demo's version of one function (``rank/original.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

if __package__ in (None, ""):  # run as a file path: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_tutorial import config  # noqa: E402
from ddp_tutorial.backend import backend_for_this_node  # noqa: E402
from ddp_tutorial.rank import original  # noqa: E402
from ddp_tutorial.rank.hooks import NO_HOOKS, Hooks  # noqa: E402
from ddp_tutorial.rank.instrument import Instrument  # noqa: E402


@dataclass
class DistEnv:
    """Where this process sits in the job; the defaults are one plain process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "none"
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.backend != "none"


class Model(nn.Module):
    """The original demo's MLP: 10 -> 100 -> 20."""

    def __init__(self, d_in: int = 10, hidden: int = 100, d_out: int = 20):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def make_inputs(size: int, seed: int) -> torch.Tensor:
    """The inputs, drawn from the seed every rank shares: all ranks build the same dataset."""
    return torch.randn(size, 10, generator=torch.Generator().manual_seed(seed))


def make_dataset(x: torch.Tensor, seed: int) -> TensorDataset:
    """``x`` and the targets a fixed, seeded teacher network gives them, so the loss can fall."""
    teacher = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 20))
    weights = torch.Generator().manual_seed(seed + 1)  # one teacher for every rank
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=weights) * 0.5)
        return TensorDataset(x, teacher(x))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)  # against the teacher's targets


def init_process_group(backend: str = "auto", timeout_s: float = 300.0, store=None) -> DistEnv:
    """Step 1: join the process group (with gloo, it returns once every rank has arrived); without
    torchrun's variables (RANK, WORLD_SIZE, ...), a single-process ``DistEnv``. ``timeout_s``: how
    long a collective waits for a lost rank; ``store``: None reads env://."""
    if "RANK" not in os.environ:
        return DistEnv()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend, why = backend_for_this_node(backend)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # one GPU per rank: LOCAL_RANK's
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 0:
        print(f"backend {backend}: {why}", flush=True)
    return DistEnv(rank, world_size, local_rank, backend, device)


def wrap_model(model: nn.Module, env: DistEnv, bucket_cap_mb: float | None = None) -> nn.Module:
    """Step 2: wrap the model in DDP (a single process keeps the plain model). DDP broadcasts rank
    0's parameters at construction and, in backward, all-reduces gradients bucket by bucket
    (``bucket_cap_mb`` MiB; None: DDP's default): every rank steps alike."""
    model = model.to(env.device)
    if not env.distributed:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)


def make_loader(dataset, env: DistEnv, batch_size: int, seed: int):
    """Step 3: give each rank a disjoint shard of the same dataset; returns (loader, sampler).
    DistributedSampler permutes the indices with ``seed + epoch``; rank r gets ``perm[r::W]``."""
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    return loader, sampler


def start_epoch(sampler: DistributedSampler, epoch: int) -> None:
    """Step 3, at the start of every epoch: a new shuffle, the same on every rank."""
    sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order


def sync_schedule(num_batches: int, accum_steps: int) -> list[bool]:
    """For each micro-batch, whether it syncs and steps: the last of each window of K (and of a
    shorter last window)."""
    return [i % accum_steps == accum_steps - 1 or i == num_batches - 1 for i in range(num_batches)]


def loss_divisors(num_batches: int, accum_steps: int) -> list[int]:
    """For each micro-batch, its window's size: the window's gradients then add up to its mean
    loss's gradient, as one K times larger batch's."""
    return [min(accum_steps, num_batches - i + i % accum_steps) for i in range(num_batches)]


def micro_step(model: nn.Module, loss_fn, x, y, loss_divisor: int, sync: bool) -> torch.Tensor:
    """One micro-batch, inside ``no_sync()`` unless it syncs; returns its loss. DDP decides in
    forward whether the coming backward all-reduces, so forward and backward both run inside."""
    skip_sync = isinstance(model, DDP) and not sync  # a plain model has nothing to skip
    with model.no_sync() if skip_sync else contextlib.nullcontext():
        loss = loss_fn(model(x), y)
        (loss / loss_divisor).backward()
    return loss


def train_epoch(model, loader, optimizer, loss_fn, accum_steps: int, epoch: int = 0,
                hooks: Hooks = NO_HOOKS) -> None:
    """Step 4: one epoch of gradient accumulation, K = ``accum_steps`` micro-batches per step;
    ``hooks``: what the kit measures and saves around each micro-step (nothing by default)."""
    syncs = sync_schedule(len(loader), accum_steps)
    divisors = loss_divisors(len(loader), accum_steps)
    device = next(model.parameters()).device
    for i, (x, y) in enumerate(loader):
        if not hooks.before_micro_step(epoch, i):
            continue  # trained before the checkpoint this run resumed from
        loss = micro_step(model, loss_fn, x.to(device), y.to(device), divisors[i], syncs[i])
        if syncs[i]:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        hooks.after_micro_step(epoch, i, syncs[i], loss)


def teardown() -> None:
    """Step 5: leave the process group: torch forgets it and calls the backend's shutdown, where it
    has one (gloo has none: its sockets close with the group's last reference, or at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv=None) -> int:
    """The five steps, with the flags of ``config.build_parser`` (``--help`` lists them)."""
    args = parse_flags(argv)
    hooks = Instrument.from_args(args)
    with original.mistakes(args.bug, sys.modules[__name__]):
        env = init_process_group(args.backend, args.pg_timeout, hooks.store(args.pg_timeout))
        try:
            torch.manual_seed(args.seed)  # one initial model (DDP broadcasts rank 0's anyway)
            model = wrap_model(Model(), env, args.bucket_cap_mb)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
            dataset = make_dataset(make_inputs(args.dataset_size, args.seed), args.seed)
            loader, sampler = make_loader(dataset, env, args.batch_size, args.seed)
            first_epoch = hooks.start(env, model, optimizer, len(loader))  # 0, or a checkpoint's
            for epoch in range(first_epoch, args.epochs):
                start_epoch(sampler, epoch)
                train_epoch(model, loader, optimizer, loss_fn, args.accum_steps, epoch, hooks)
            hooks.finish(model)
        finally:
            model = None  # DDP holds the group: freed after destroy, it can deadlock gloo (README)
            teardown()  # even when a step above raised
    return 0


def parse_flags(argv=None):
    """Parsed and checked flags (a bad one exits with status 2); applies ``--threads``."""
    parser = config.build_parser()
    args = parser.parse_args(argv)
    try:
        config.validate(args, int(os.environ.get("WORLD_SIZE", 1)))
    except config.ConfigError as exc:
        parser.error(str(exc))
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # N ranks x all cores each would thrash a small machine
    return args


if __name__ == "__main__":
    from ddp_tutorial.rank.bootstrap import exit_skipping_interpreter_cleanup

    exit_skipping_interpreter_cleanup(main())  # gloo objects freed at exit can abort
