"""Measure what DDP itself costs, in one process group: buckets, overlap, accumulation, our own timing.

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('perf_ddp.py'), 2, ['--quick'])"
    torchrun --standalone --nproc-per-node 2 ddp_tutorial/perf/workers/perf_ddp.py

The model is a deep, narrow MLP: many small parameter tensors, as the DDP paper
uses to show why gradients are bucketed. Sections (each reported by rank 0 with
``runfolder.report`` under its own key):

- ``compute``: forward+backward+optimizer seconds per sample, one rank, no communication.
- ``buckets``: a sweep of ``bucket_cap_mb``: all-reduce calls per step, backward time, CPU time.
- ``overlap``: DDP vs a hand-written all-reduce per gradient after backward vs one
  flat all-reduce after backward vs no communication; wall and CPU time per step,
  DDP's own overlap counter, and how many all-reduces start before backward ends.
- ``accumulation``: K = 1, 2, 4, 8 through ``train.train_epoch`` (the full run adds stragglers).
- ``overhead``: ``train.train_epoch`` with the kit's hooks (``instrument.Instrument``:
  ``SyncTimer`` and a JSON line per step) vs without, taking turns step by step.
- ``fidelity``: ``SyncTimer``'s sync time vs DDP's logger ``avg_backward_comm_time``.

Every section calls the training script's own functions with real arguments.
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.rank.hooks import NO_HOOKS
from ddp_tutorial.rank.instrument import Instrument
from ddp_tutorial.rank.timing import SyncTimer
from ddp_tutorial.runfolder import MetricsWriter, rank_run_dir, report
from ddp_tutorial.perf.workers.perf_steps import (ManySmallParams, StepLog, batches, medians, model_bytes,
                                                  one_epoch, run_epoch, sync_device, timed_steps)
from ddp_tutorial.train import init_process_group, loss_fn, teardown, train_epoch


# -- Sections -----------------------------------------------------------------
def measure_compute(base, env, batch_size: int, steps: int) -> dict:
    """Seconds per sample of forward+backward+step on one rank, nothing to communicate."""
    model = copy.deepcopy(base).to(env.device)
    data = batches(env, batch_size, steps + 2)
    timed_steps(model, data[:2])  # warm-up
    timed = timed_steps(model, data[2:])
    return {"step_s": timed["step_s"], "backward_s": timed["backward_s"],
            "s_per_sample": timed["step_s"] / batch_size, "batch_size": batch_size}


def measure_buckets(base, env, caps_mb, batch_size: int, steps: int, rounds: int) -> list:
    """For each ``bucket_cap_mb``: all-reduce calls per step (SyncTimer counts them), backward time.

    The caps take turns round by round on the same data, so a slow spell of a shared
    machine hits them alike; each time is the median over ``rounds * steps`` steps.
    """
    data = batches(env, batch_size, steps, seed=1)
    models = {}
    for cap in caps_mb:
        model = DDP(copy.deepcopy(base).to(env.device), bucket_cap_mb=cap)
        timer = SyncTimer()
        model.register_comm_hook(timer, SyncTimer.hook)
        timed_steps(model, data[:2])  # DDP rebuilds its buckets after the first step
        timer.start_step()
        models[cap] = (model, timer)
    per_round = {cap: [] for cap in caps_mb}
    for _ in range(rounds):
        for cap, (model, _) in models.items():
            per_round[cap].append(timed_steps(model, data))
    return [{"bucket_cap_mb": cap, "allreduce_calls_per_step": timer.calls / (rounds * steps),
             "steps": rounds * steps, **medians(per_round[cap])} for cap, (_, timer) in models.items()]


def allreduce_each_gradient(model) -> None:
    """By hand, after backward: one all-reduce per parameter, then average."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def allreduce_flat(model) -> None:
    """By hand, after backward: copy every gradient into one flat tensor, one all-reduce, copy back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class LaunchRecorder:
    """A comm hook state: DDP's default all-reduce, and the time each bucket's all-reduce was launched."""

    def __init__(self):
        self.launches = []

    @staticmethod
    def hook(state: "LaunchRecorder", bucket):
        state.launches.append(time.perf_counter())
        return default_hooks.allreduce_hook(None, bucket)


def launches_during_backward(base, env, bucket_cap_mb: float, batch_size: int, steps: int = 3) -> dict:
    """How many of DDP's all-reduces start before backward has computed its last gradient.

    Backward computes the first layer's gradients last; a tensor hook on its weight
    marks that moment, and a comm hook marks each all-reduce's launch. Counted on the
    last of ``steps`` steps (DDP rebuilds its buckets after the first one).
    """
    model = DDP(copy.deepcopy(base).to(env.device), bucket_cap_mb=bucket_cap_mb)
    recorder = LaunchRecorder()
    model.register_comm_hook(recorder, LaunchRecorder.hook)
    first_weight = next(model.module.parameters())
    last_gradient = []
    first_weight.register_hook(lambda grad: last_gradient.append(time.perf_counter()))
    for x, y in batches(env, batch_size, steps, seed=3):
        recorder.launches.clear()
        last_gradient.clear()
        nn.functional.mse_loss(model(x), y).backward()
    return {"allreduces": len(recorder.launches),
            "launched_before_last_gradient": sum(t < last_gradient[0] for t in recorder.launches)}


def measure_overlap(base, env, bucket_cap_mb: float, batch_size: int, steps: int, rounds: int) -> dict:
    """DDP against syncing after backward by hand, and no sync at all, interleaved round by round.

    Four ways on the same data: DDP (``bucket_cap_mb``: several buckets, overlapped with
    backward), an all-reduce per gradient after backward, one flat all-reduce after
    backward, and no communication (the compute alone). Besides wall time, each step's
    CPU time: the whole process's (gloo's threads included) and the main thread's.
    """
    data = batches(env, batch_size, steps, seed=2)
    ddp = DDP(copy.deepcopy(base).to(env.device), bucket_cap_mb=bucket_cap_mb)
    plain = copy.deepcopy(base).to(env.device)
    ways = {"ddp": (ddp, None), "per_gradient": (plain, allreduce_each_gradient),
            "flat": (plain, allreduce_flat), "none": (plain, None)}
    per_round = {name: [] for name in ways}
    for model, after in ways.values():
        timed_steps(model, data[:2], after)  # warm-up (and DDP's bucket rebuild)
    for _ in range(rounds):
        for name, (model, after) in ways.items():
            per_round[name].append(timed_steps(model, data, after))
    logging = ddp._get_ddp_logging_data()
    result = {}
    for name, rows in per_round.items():
        for key, value in medians(rows).items():
            result[f"{name}_{key}"] = value
    for key in ("avg_backward_compute_comm_overlap_time", "avg_backward_comm_time",
                "avg_backward_compute_time"):
        result[key + "_s"] = logging.get(key, 0) / 1e9
    result["bucket_cap_mb"] = bucket_cap_mb
    result.update(launches_during_backward(base, env, bucket_cap_mb, batch_size))
    result["cores"] = os.cpu_count()
    result["ranks"] = env.world_size
    return result


def measure_accumulation(base, env, ks, straggler_ms_list, batch_size: int, optimizer_steps: int) -> list:
    """Each K and straggler delay through ``train.train_epoch``: time per sample, transfer and wait."""
    rows = []
    for straggler_ms in straggler_ms_list:
        for k in ks:
            log = StepLog()
            wall, allreduced_bytes = run_epoch(DDP(copy.deepcopy(base).to(env.device)), env, batch_size, k,
                                               k * optimizer_steps, log, straggler_ms)
            samples = len(log.records) * batch_size * env.world_size
            transfer_s, wait_s = split_sync(log.records)
            opt_steps = sum(r["optimizer_step"] for r in log.records)
            rows.append({"accum_steps": k, "straggler_ms": straggler_ms, "s_per_sample": wall / samples,
                         "sync_s_per_optimizer_step": transfer_s + wait_s,
                         "transfer_s_per_optimizer_step": transfer_s, "wait_s_per_optimizer_step": wait_s,
                         "transfer_s_per_sample": transfer_s / (k * batch_size * env.world_size),
                         "allreduced_bytes_per_sample": allreduced_bytes / samples,
                         "allreduce_calls_per_micro_step": sum(r["allreduce_calls"] for r in log.records)
                         / len(log.records),
                         "optimizer_steps": opt_steps, "micro_steps": len(log.records)})
    return rows


def split_sync(records) -> tuple:
    """(transfer, wait) seconds of the syncs of an epoch, from every rank's sync times.

    Every rank's sync time holds the transfer plus its wait for the last rank to arrive.
    The last to arrive waits for nobody, so the smallest sync time over the ranks is the
    transfer, and the largest minus the smallest the wait. Transfer: the fastest optimizer
    step's (the all-reduce is the same every step; a busy machine only ever adds time).
    Wait: the median over optimizer steps.
    """
    mine = [r["sync_s"] for r in records if r["optimizer_step"]]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    per_step = list(zip(*every_rank))
    transfer = min(min(step) for step in per_step)
    wait = statistics.median(max(step) - min(step) for step in per_step)
    return transfer, wait


def measure_overhead(base, env, batch_size: int, steps: int, blocks: int, run_dir: str) -> dict:
    """Step 4 with the kit's hooks (SyncTimer + a JSON line per step) vs without, step by step.

    Both models train through the real ``train.train_epoch``, one micro-step per
    call, taking turns (the order flips every pair), so a slow spell of a shared
    machine hits both alike; the medians of ``steps * blocks`` single steps are
    compared, which a few descheduled steps cannot move.
    """
    loader, _ = one_epoch(env, batch_size, 1)  # an "epoch" of exactly one micro-step
    metrics = MetricsWriter(os.path.join(run_dir, "instrumented"), env.rank)
    variants = {}
    for name in ("plain", "timed"):
        model = DDP(copy.deepcopy(base).to(env.device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        hooks = Instrument(records=metrics) if name == "timed" else NO_HOOKS
        hooks.start(env, model, optimizer, len(loader))
        variants[name] = (model, optimizer, hooks)

    def one_step(name):
        model, optimizer, hooks = variants[name]
        t0 = time.perf_counter()
        train_epoch(model, loader, optimizer, loss_fn, 1, 0, hooks)
        sync_device(env.device)
        return time.perf_counter() - t0

    for _ in range(5):  # warm-up: bucket rebuild, allocator, first-call paths
        one_step("plain"), one_step("timed")
    dist.barrier()
    times = {"plain": [], "timed": []}
    for i in range(steps * blocks):
        for name in (("plain", "timed") if i % 2 == 0 else ("timed", "plain")):
            times[name].append(one_step(name))
    metrics.close()
    plain_s, timed_s = statistics.median(times["plain"]), statistics.median(times["timed"])
    return {"plain_step_s": plain_s, "instrumented_step_s": timed_s, "overhead": timed_s / plain_s - 1.0,
            "steps_per_block": steps, "blocks": blocks, "steps": steps * blocks}


def measure_fidelity(base, env, batch_size: int) -> dict:
    """SyncTimer vs DDP's logger on the same iterations.

    DDP's logger records the backward of sync iterations 1..10 (then every 100th),
    each one when the next forward starts; so after 11 steps it holds steps 0..9.
    """
    steps = 11
    model = DDP(copy.deepcopy(base).to(env.device), bucket_cap_mb=0.05)
    log = StepLog()
    run_epoch(model, env, batch_size, 1, steps, log)
    ours = statistics.mean(r["sync_s"] for r in log.records[:10])
    ddp_s = model._get_ddp_logging_data().get("avg_backward_comm_time", 0) / 1e9
    return {"synctimer_s": ours, "ddp_logger_s": ddp_s,
            "ratio": ours / ddp_s if ddp_s > 0 else float("nan"), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and settings (a few seconds)")
    parser.add_argument("--sections", nargs="*",
                        default=["compute", "buckets", "overlap", "accumulation", "overhead", "fidelity"])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    env = init_process_group(args.backend)
    try:
        torch.manual_seed(0)
        base = ManySmallParams()
        steps = 8 if quick else 30
        results = {"model_bytes": model_bytes(base), "param_tensors": len(list(base.parameters())),
                   "world_size": env.world_size, "backend": env.backend, "quick": quick}
        if "compute" in args.sections:
            results["compute"] = measure_compute(base, env, 32, steps)
        if "buckets" in args.sections:
            caps = [0.001, 0.02, 0.05, 25.0] if quick else [0.0005, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 25.0]
            results["buckets"] = measure_buckets(base, env, caps, 32, steps, 2 if quick else 5)
        if "overlap" in args.sections:
            results["overlap"] = measure_overlap(base, env, 0.05, 32, steps, 2 if quick else 5)
        if "accumulation" in args.sections:
            results["accumulation"] = measure_accumulation(
                base, env, [1, 2, 4, 8], [0.0] if quick else [0.0, 5.0], 16, 6 if quick else 12)
        if "overhead" in args.sections:
            results["overhead"] = measure_overhead(base, env, 16, 5 if quick else 10, 6 if quick else 30,
                                                   rank_run_dir("runs/manual"))
        if "fidelity" in args.sections:
            results["fidelity"] = measure_fidelity(base, env, 32)
        if env.rank == 0:
            report(results)
            print("measured: " + ", ".join(k for k in results if isinstance(results[k], (dict, list))),
                  flush=True)
    finally:
        teardown()


if __name__ == "__main__":
    main()
