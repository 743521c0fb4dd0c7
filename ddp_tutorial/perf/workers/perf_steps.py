"""What ``perf_ddp.py``'s sections share: the model of many small tensors, and timed training steps.

``run_epoch`` runs the kit's real step 4 (``train.train_epoch``) with its hooks; ``timed_steps``
runs plain steps and takes the median of each measure.
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_tutorial.rank.instrument import Instrument
from ddp_tutorial.train import loss_fn, make_dataset, make_inputs, make_loader, start_epoch, train_epoch


class ManySmallParams(nn.Module):
    """10 -> width -> ... -> width -> 20: ``depth`` hidden layers, two small tensors each."""

    def __init__(self, depth: int = 24, width: int = 64):
        super().__init__()
        layers = [nn.Linear(10, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 20))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sync_device(device) -> None:
    """Wait for the GPU, so a wall-clock reading includes its work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepLog:
    """Collects the step records of ``instrument.Instrument`` in memory (it only needs ``write``)."""

    def __init__(self):
        self.records = []

    def write(self, record):
        if record["kind"] == "step":
            self.records.append(record)


def one_epoch(env, batch_size: int, micro_steps: int, seed: int = 0):
    """Step 3 for an epoch of exactly ``micro_steps`` micro-batches per rank: (loader, sampler)."""
    dataset = make_dataset(make_inputs(env.world_size * batch_size * micro_steps, seed), seed)
    loader, sampler = make_loader(dataset, env, batch_size, seed)
    start_epoch(sampler, 0)
    return loader, sampler


def run_epoch(model, env, batch_size: int, accum_steps: int, micro_steps: int, log: StepLog,
              straggler_ms: float = 0.0) -> tuple:
    """One epoch of the kit's real step 4, ``train.train_epoch``, with its hooks.

    Returns:
        (wall seconds, gradient bytes this rank all-reduced, counted by the sync timer).

    Args:
        model: a DDP model.
        env: from ``train.init_process_group``.
        batch_size: micro-batch size per rank.
        accum_steps: K.
        micro_steps: micro-batches in the epoch, per rank.
        log: where the hooks write the step records.
        straggler_ms: each micro-step first sleeps a random 0..straggler_ms ms.
    """
    loader, _ = one_epoch(env, batch_size, micro_steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = Instrument(records=log, straggler_ms=straggler_ms)
    hooks.start(env, model, optimizer, len(loader))
    dist.barrier()
    t0 = time.perf_counter()
    train_epoch(model, loader, optimizer, loss_fn, accum_steps, 0, hooks)
    sync_device(env.device)
    return time.perf_counter() - t0, hooks.timer.sync.total_bytes


def batches(env, batch_size: int, count: int, seed: int = 0):
    """``count`` random (input, target) micro-batches on this rank's device, different per rank."""
    g = torch.Generator().manual_seed(seed + env.rank)
    return [(torch.randn(batch_size, 10, generator=g).to(env.device),
             torch.randn(batch_size, 20, generator=g).to(env.device)) for _ in range(count)]


def timed_steps(model, data, after_backward=None) -> dict:
    """One step per micro-batch (forward, backward, sync, SGD step); the median of each measure.

    Returns:
        ``step_s``, ``backward_s`` (under DDP: until its last all-reduce is done), ``sync_s``
        (``after_backward``, 0 without), ``cpu_s`` (CPU seconds of the whole process per step:
        every thread, gloo's included) and ``main_cpu_s`` (CPU seconds of this thread alone).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    device = data[0][0].device
    rows = []
    dist.barrier()
    for x, y in data:
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()  # under DDP this returns after the last bucket's all-reduce
        sync_device(device)
        t2 = time.perf_counter()
        if after_backward is not None:
            after_backward(model)
            sync_device(device)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync_device(device)
        rows.append({"step_s": time.perf_counter() - t0, "backward_s": t2 - t1, "sync_s": t3 - t2,
                     "cpu_s": time.process_time() - c0, "main_cpu_s": time.thread_time() - m0})
    return medians(rows)


def medians(rows) -> dict:
    """The median of each key over a list of dicts of numbers."""
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}
