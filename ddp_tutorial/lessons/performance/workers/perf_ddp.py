"""What DDP itself costs, in one launch: buckets, overlap, accumulation, our timing, where the
gradients live, on a deep, narrow MLP (many small tensors, as in the DDP paper). Rank 0 reports
each section (``measure_<section>``) under its name, and ``compute`` (seconds per sample)."""

import argparse
import copy
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.rank.hooks import NO_HOOKS
from ddp_tutorial.rank.instrument import Instrument
from ddp_tutorial.rank.timing import SyncTimer
from ddp_tutorial.runfolder import MetricsWriter, rank_run_dir, report
from ddp_tutorial.train import (init_process_group, loss_fn, make_dataset, make_inputs, make_loader,
                                start_epoch, teardown, train_epoch)


def deep_model(width: int, depth: int) -> nn.Sequential:
    """10 -> width -> ... -> 20, ``depth`` hidden layers of width x width."""
    layers = [nn.Linear(10, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 20))


def sync_device(device) -> None:
    """Wait for the GPU, so a wall-clock reading includes its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_epoch(env, batch_size: int, micro_steps: int):
    """The loader of an epoch of exactly ``micro_steps`` micro-batches per rank."""
    dataset = make_dataset(make_inputs(env.world_size * batch_size * micro_steps, 0), 0)
    loader, sampler = make_loader(dataset, env, batch_size, 0)
    start_epoch(sampler, 0)
    return loader


def run_epoch(model, env, batch_size: int, accum_steps: int, micro_steps: int,
              straggler_ms: float = 0.0) -> tuple:
    """An epoch of ``micro_steps`` through the kit's ``train_epoch`` and hooks (straggler sleeps
    0..``straggler_ms`` ms): wall seconds, gradient bytes all-reduced, the step records."""
    loader = one_epoch(env, batch_size, micro_steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    log = []  # Instrument's records, in memory
    hooks = Instrument(records=SimpleNamespace(write=log.append), straggler_ms=straggler_ms)
    hooks.start(env, model, optimizer, len(loader))
    dist.barrier()
    t0 = time.perf_counter()
    train_epoch(model, loader, optimizer, loss_fn, accum_steps, 0, hooks)
    sync_device(env.device)
    return (time.perf_counter() - t0, hooks.timer.sync.total_bytes,
            [r for r in log if r["kind"] == "step"])


def batches(env, batch_size: int, count: int, seed: int = 0):
    """``count`` random (input, target) micro-batches on this rank's device, per rank."""
    g = torch.Generator().manual_seed(seed + env.rank)
    return [(torch.randn(batch_size, 10, generator=g).to(env.device),
             torch.randn(batch_size, 20, generator=g).to(env.device)) for _ in range(count)]


def timed_steps(model, data, after_backward=None) -> dict:
    """A step per micro-batch, the medians: ``step_s``, ``backward_s`` (under DDP until its last
    all-reduce is done), ``cpu_s`` (CPU time of every thread, gloo's included)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    device = data[0][0].device
    rows = []
    dist.barrier()
    for x, y in data:
        t0, c0 = time.perf_counter(), time.process_time()
        loss = nn.functional.mse_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()  # under DDP this returns after the last bucket's all-reduce
        sync_device(device)
        t2 = time.perf_counter()
        if after_backward is not None:
            after_backward(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync_device(device)
        rows.append({"step_s": time.perf_counter() - t0, "backward_s": t2 - t1,
                     "cpu_s": time.process_time() - c0})
    return medians(rows)


def medians(rows) -> dict:
    """The median of each key over a list of dicts."""
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def measure_buckets(new_model, env, caps_mb, batch_size: int, steps: int, rounds: int) -> list:
    """Per ``bucket_cap_mb``: all-reduce calls per step and the median times, the caps taking
    turns round by round on the same data."""
    data = batches(env, batch_size, steps, seed=1)
    models = {}
    for cap in caps_mb:
        model, timer = DDP(new_model(), bucket_cap_mb=cap), SyncTimer()
        model.register_comm_hook(timer, SyncTimer.hook)
        timed_steps(model, data[:2])  # DDP rebuilds its buckets after the first step
        timer.start_step()
        models[cap] = (model, timer)
    per_round = {cap: [] for cap in caps_mb}
    for _ in range(rounds):
        for cap, (model, _) in models.items():
            per_round[cap].append(timed_steps(model, data))
    return [{"bucket_cap_mb": cap, "allreduce_calls_per_step": timer.calls / (rounds * steps),
             "steps": rounds * steps, **medians(per_round[cap])}
            for cap, (_, timer) in models.items()]


def allreduce_each_gradient(model) -> None:
    """By hand, after backward: one all-reduce per parameter."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def allreduce_flat(model) -> None:
    """By hand, after backward: every gradient into one flat tensor, one all-reduce, copied back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def record_launch(launches: list, bucket):
    """A comm hook: DDP's default all-reduce, and the time each bucket's all-reduce was launched."""
    launches.append(time.perf_counter())
    return default_hooks.allreduce_hook(None, bucket)


def launches_during_backward(model, env, batch_size: int, steps: int = 3) -> dict:
    """How many all-reduces start before backward computed its last gradient (the first layer's
    weight's), on the last of ``steps`` steps (DDP rebuilds its buckets after the first)."""
    launches, last_gradient = [], []
    model.register_comm_hook(launches, record_launch)
    first_weight = next(model.module.parameters())
    first_weight.register_hook(lambda _: last_gradient.append(time.perf_counter()))
    for x, y in batches(env, batch_size, steps, seed=3):
        launches.clear()
        last_gradient.clear()
        nn.functional.mse_loss(model(x), y).backward()
    return {"allreduces": len(launches),
            "launched_before_last_gradient": sum(t < last_gradient[0] for t in launches)}


def measure_overlap(new_model, env, bucket_cap_mb: float, batch_size: int, steps: int,
                    rounds: int) -> dict:
    """Wall and CPU time per step of four ways, taking turns on the same data: DDP, an all-reduce
    per gradient or one flat one after backward, no communication (the compute alone)."""
    data = batches(env, batch_size, steps, seed=2)
    ddp, plain = DDP(new_model(), bucket_cap_mb=bucket_cap_mb), new_model()
    ways = {"ddp": (ddp, None), "per_gradient": (plain, allreduce_each_gradient),
            "flat": (plain, allreduce_flat), "none": (plain, None)}
    for model, after in ways.values():
        timed_steps(model, data[:2], after)  # warm-up (and DDP's bucket rebuild)
    per_round = {name: [] for name in ways}
    for _ in range(rounds):
        for name, (model, after) in ways.items():
            per_round[name].append(timed_steps(model, data, after))
    logging = ddp._get_ddp_logging_data()
    return {**{f"{name}_{key}": value for name, rows in per_round.items()
               for key, value in medians(rows).items()},
            **{f"{key}_s": logging.get(key, 0) / 1e9 for key in (
                "avg_backward_compute_comm_overlap_time", "avg_backward_comm_time",
                "avg_backward_compute_time")},
            **launches_during_backward(DDP(new_model(), bucket_cap_mb=bucket_cap_mb), env,
                                       batch_size),
            "bucket_cap_mb": bucket_cap_mb, "cores": os.cpu_count(), "ranks": env.world_size}


def measure_accumulation(new_model, env, ks, straggler_ms_list, batch_size: int,
                         optimizer_steps: int) -> list:
    """Each K and straggler delay through ``train.train_epoch``: time per sample, transfer, wait."""
    rows = []
    for straggler_ms in straggler_ms_list:
        for k in ks:
            wall, allreduced, log = run_epoch(DDP(new_model()), env, batch_size, k,
                                              k * optimizer_steps, straggler_ms)
            micro_steps = len(log)
            samples = micro_steps * batch_size * env.world_size
            transfer_s, wait_s = split_sync(log)
            rows.append({"accum_steps": k, "straggler_ms": straggler_ms,
                         "s_per_sample": wall / samples,
                         "transfer_s_per_optimizer_step": transfer_s,
                         "wait_s_per_optimizer_step": wait_s,
                         "transfer_s_per_sample": transfer_s / (k * batch_size * env.world_size),
                         "allreduced_bytes_per_sample": allreduced / samples,
                         "allreduce_calls_per_micro_step":
                             sum(r["allreduce_calls"] for r in log) / micro_steps,
                         "optimizer_steps": sum(r["optimizer_step"] for r in log),
                         "micro_steps": micro_steps})
    return rows


def split_sync(records) -> tuple:
    """(transfer, wait) of an epoch's syncs over the ranks (notebook 07): the fastest step's
    smallest sync time (a busy machine only adds time); the median of largest minus smallest."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, [r["sync_s"] for r in records if r["optimizer_step"]])
    per_step = list(zip(*every_rank))
    return (min(min(step) for step in per_step),
            statistics.median(max(step) - min(step) for step in per_step))


def measure_overhead(new_model, env, batch_size: int, steps: int, run_dir: str) -> dict:
    """``train_epoch``'s micro-step with the kit's hooks (SyncTimer, a JSON line per step) vs
    without, taking turns so a slow spell hits both alike: the medians of ``steps`` steps."""
    loader = one_epoch(env, batch_size, 1)  # an "epoch" of exactly one micro-step
    metrics = MetricsWriter(os.path.join(run_dir, "instrumented"), env.rank)
    variants, times = {}, {"plain": [], "timed": []}
    for name, hooks in (("plain", NO_HOOKS), ("timed", Instrument(records=metrics))):
        model = DDP(new_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        hooks.start(env, model, optimizer, len(loader))
        variants[name] = (model, optimizer, hooks)
    dist.barrier()
    for i in range(steps + 10):  # the first 10 warm up: bucket rebuild, allocator, first calls
        for name in (("plain", "timed") if i % 2 == 0 else ("timed", "plain")):
            model, optimizer, hooks = variants[name]
            t0 = time.perf_counter()
            train_epoch(model, loader, optimizer, loss_fn, 1, 0, hooks)
            sync_device(env.device)
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    metrics.close()
    plain_s, timed_s = statistics.median(times["plain"]), statistics.median(times["timed"])
    return {"plain_step_s": plain_s, "instrumented_step_s": timed_s,
            "overhead": timed_s / plain_s - 1.0, "steps": steps}


def measure_fidelity(new_model, env, batch_size: int) -> dict:
    """SyncTimer vs DDP's logger on the same iterations: the logger records sync iterations 1..10
    (reducer.hpp should_collect_runtime_stats), each at the next forward: after 11 steps, 0..9."""
    model = DDP(new_model(), bucket_cap_mb=0.05)
    log = run_epoch(model, env, batch_size, 1, 11)[-1]
    ours = statistics.mean(r["sync_s"] for r in log[:10])
    ddp_s = model._get_ddp_logging_data().get("avg_backward_comm_time", 0) / 1e9
    return {"synctimer_s": ours, "ddp_logger_s": ddp_s,
            "ratio": ours / ddp_s if ddp_s > 0 else float("nan")}


def record_bucket(storages: dict, bucket):
    """A comm hook: DDP's default all-reduce, and the bucket's storage recorded."""
    storage = bucket.buffer().untyped_storage()
    storages[storage.data_ptr()] = storage.nbytes()
    return default_hooks.allreduce_hook(None, bucket)


def where_grads_live(model, storages: dict) -> dict:
    """The storages behind the ``.grad`` tensors, and their bytes inside the buckets."""
    grads = [p.grad for p in model.parameters()]
    return {"grad_storages": len({g.untyped_storage().data_ptr() for g in grads}),
            "buckets": len(storages),
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "bucket_bytes": sum(storages.values()),
            "grad_bytes_inside_buckets": sum(g.numel() * g.element_size() for g in grads
                                             if g.untyped_storage().data_ptr() in storages)}


def measure_grad_view(env, steps: int) -> list:
    """Where DDP keeps the gradients: an MLP wrapped with and without ``gradient_as_bucket_view``,
    each with ``zero_grad(set_to_none=...)`` both ways; the median step of the settings taking
    turns step by step, and where the ``.grad`` tensors live after a backward."""
    x, y = torch.randn(32, 10, device=env.device), torch.randn(32, 20, device=env.device)
    runs = {}
    for view, set_to_none in [(False, True), (True, True), (False, False), (True, False)]:
        torch.manual_seed(0)
        model = DDP(deep_model(width=256, depth=7).to(env.device), gradient_as_bucket_view=view)
        storages = {}
        model.register_comm_hook(storages, record_bucket)
        runs[view, set_to_none] = (model, storages, torch.optim.SGD(model.parameters(), lr=1e-3))
    times = {setting: [] for setting in runs}
    for i in range(steps + 3):  # taking turns, so load hits them alike
        for (view, set_to_none), (model, _, optimizer) in runs.items():
            t0 = time.perf_counter()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            sync_device(env.device)
            if i >= 3:  # the first steps build and rebuild the buckets
                times[view, set_to_none].append(time.perf_counter() - t0)
    rows = []
    for (view, set_to_none), (model, storages, _) in runs.items():
        storages.clear()  # only this backward's buckets (the first one had a single bucket)
        nn.functional.mse_loss(model(x), y).backward()  # leave .grad in place to inspect it
        rows.append({"gradient_as_bucket_view": view, "set_to_none": set_to_none,
                     "step_s": statistics.median(times[view, set_to_none]),
                     **where_grads_live(model, storages)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and settings")
    parser.add_argument("--sections", nargs="*", help="the sections to run (default: all)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--steps", type=int, help="steps per setting (default: 8 quick, else 30)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    rounds, stragglers = (2, [0.0]) if quick else (5, [0.0, 5.0])
    steps = args.steps or (8 if quick else 30)
    caps = [0.001, 0.02, 0.05, 25] if quick else [0.0005, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 25]
    env = init_process_group(args.backend)
    try:
        torch.manual_seed(0)
        base = deep_model(width=64, depth=24)

        def new_model():
            return copy.deepcopy(base).to(env.device)

        sections = {
            "buckets": lambda: measure_buckets(new_model, env, caps, 32, steps, rounds),
            "overlap": lambda: measure_overlap(new_model, env, 0.05, 32, steps, rounds),
            "accumulation": lambda: measure_accumulation(new_model, env, [1, 2, 4, 8], stragglers,
                                                         16, 6 if quick else 12),
            "overhead": lambda: measure_overhead(new_model, env, 16, 30 if quick else 300,
                                                 rank_run_dir("runs/manual")),
            "fidelity": lambda: measure_fidelity(new_model, env, 32),
            "grad_view": lambda: measure_grad_view(env, steps),
        }
        measured = {name: run() for name, run in sections.items()
                    if name in (args.sections or sections)}
        if "overlap" in measured:  # its way without communication is the compute alone
            measured["compute"] = {"s_per_sample": measured["overlap"]["none_step_s"] / 32,
                                   "batch_size": 32}
        if env.rank == 0:
            report({"model_bytes": sum(p.numel() * p.element_size() for p in base.parameters()),
                    "world_size": env.world_size,
                    "param_tensors": len(list(base.parameters())), "backend": env.backend,
                    "quick": quick, **measured})
            print("measured: " + ", ".join(measured), flush=True)
    finally:
        teardown()


if __name__ == "__main__":
    main()
