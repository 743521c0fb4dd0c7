"""DDP built by hand against torch's on the same model and data. ``--parts``: construct, exact
(W = 2, 3 and 4 in groups of ranks 0..W-1), overlap (W = 2, the timing model), cases (no_sync,
find_unused_parameters) and hang (under a launch deadline); each reports records ``part``=name."""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import runfolder
from ddp_tutorial.lessons.build_ddp.workers.lab_models import (
    BranchModel, ScaleModel, ToyModel, batch, branch_batch, flat, seeded, sgd)
from ddp_tutorial.lessons.build_ddp.workers.lab_recording import ddp, log, quiet_stderr, readiness
from ddp_tutorial.lessons.build_ddp.workers.my_ddps import (
    BucketDDP, FlatDDP, NaiveDDP, OverlapDDP, SimulatedGpuKernel)
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import digest, shard
from ddp_tutorial.lessons.sharding.workers.sharding_common import run_parts

PARTS = ("construct", "exact", "overlap", "cases", "hang")
#: Caps (MiB) that cut the toy model's 2,132 trainable bytes into 1, 2 and 3 buckets by BucketDDP's
#: rule (never past the cap); by DDP's (closed once it reaches the cap) into 1, 1 and 2.
CAPS = {1: 1.0, 2: 1500 / 2**20, 3: 1100 / 2**20}
#: BucketDDP's cap on the timing model (1.2 MB of gradients in 8 tensors): several tensors a bucket.
TIMING_BUCKET_CAP_MB = 1.0
VERSIONS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP,
            "bucket": lambda m, group=None: BucketDDP(m, CAPS[2], group=group)}
#: The timing model: widths, and the simulated GPU kernel's backward per layer (ms).
WIDE, KERNEL_MS = 384, 10.0


def timing_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, 5))


def wrap(version, model, group):
    if version in ("ddp", "ddp_default"):
        return ddp(model, group, hook=version == "ddp")
    return VERSIONS[version](model, group=group)


def loss(model, x, y, rank, world_size):
    """The loss of this rank's rows of the global batch ``x, y``."""
    return F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size))


def sync(model):
    """After backward: a hand-made DDP needs its call; torch's DDP synced inside backward."""
    if not isinstance(model, DDP):
        model.finish_gradient_synchronization()


def part_construct(args, rank, world_size):
    rank0 = digest(seeded(ToyModel, args.seed).parameters())  # what rank 0 builds
    for version in (*VERSIONS, "ddp"):
        model = seeded(ToyModel, args.seed + rank)  # a different start on every rank
        before = digest(model.parameters())
        with log.recording():
            wrapped = wrap(version, model, None)
        runfolder.report({"part": "construct", "version": version, "before": before,
                          "after": digest([*wrapped.parameters(), *wrapped.buffers()]),
                          "rank0_built": rank0,
                          "broadcasts": sum(c["op"] == "broadcast" for c in log.take())})
    # Each rank sets its buffer after construction; what does a forward see? DDP broadcasts rank 0's
    # before every forward (distributed.py _pre_forward -> _check_sync_bufs_pre_fwd -> _sync_buffers).
    for version in (*VERSIONS, "ddp"):
        model = ScaleModel()
        wrapped = wrap(version, model, None)
        with torch.no_grad():
            model.scale.fill_(rank + 1)
        seen = []
        model.register_forward_pre_hook(lambda m, _: seen.append(float(m.scale)))
        with torch.no_grad():
            wrapped(torch.ones(2, 3))
        runfolder.report({"part": "buffers", "version": version, "set": rank + 1, "seen": seen[0]})


def train(model, steps, seed, rank, world_size, rows_per_rank, grads=None):
    """SGD steps; per step the all-reduces, bytes and seconds. ``grads`` gets the first step's
    averaged gradients (flat), as the optimizer reads them."""
    optimizer, per_step = sgd(model), []
    for step in range(steps):
        x, y = batch(seed, step, rows_per_rank * world_size, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        with log.recording():
            loss(model, x, y, rank, world_size).backward()
            sync(model)
        calls = [c for c in log.take() if c["op"] == "all_reduce"]
        per_step.append({"all_reduces": len(calls), "bytes": sum(c["bytes"] for c in calls),
                         "seconds": [c["done"] - c["launch"] for c in calls]})
        if grads is not None and step == 0:
            grads.extend(float(v) for p in model.parameters() if p.grad is not None
                         for v in p.grad.reshape(-1))
        optimizer.step()
    return per_step


def float64_reference(args, world_size):
    """One process on the global batch, in float64: the size of float32's rounding."""
    model = seeded(ToyModel, args.seed).double()
    optimizer = sgd(model)
    for step in range(args.steps):
        x, y = batch(args.seed, step, args.batch_size * world_size, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x.double()), y.double()).backward()
        optimizer.step()
    return flat(model)


def part_exact(args, rank, world_size):
    for w in range(2, min(world_size, 4) + 1):
        group = dist.new_group(list(range(w)))  # every rank takes part in creating it
        if rank >= w:
            continue
        finals, steps, first_grads = {}, {}, {"ddp": [], "ddp_default": []}
        for version in (*VERSIONS, "ddp", "ddp_default"):
            model = wrap(version, seeded(ToyModel, args.seed), group)
            steps[version] = train(model, args.steps, args.seed, rank, w, args.batch_size,
                                   first_grads.get(version))
            finals[version] = flat(model)
            grads = {n: p.grad is not None for n, p in model.named_parameters()}
        buckets = {}
        for n, cap in CAPS.items():
            model = BucketDDP(seeded(ToyModel, args.seed), cap, group=group)
            names = {id(p): name for name, p in model.module.named_parameters()}
            buckets[n] = {"cap_mb": cap, "buckets": [[names[id(p)] for p in b] for b in model.buckets],
                          "per_step": train(model, 2, args.seed, rank, w, args.batch_size)}
            if w == 2:
                buckets[n]["ddp"] = ddp_iterations(group, cap, args, rank, w)
        record = {"part": "exact", "world_size": w, "finals": finals, "steps": steps,
                  "buckets": buckets, "has_grad": grads, "first_grads": first_grads}
        if rank == 0:
            record["float64"] = float64_reference(args, w)
        runfolder.report(record)


def ddp_iterations(group, cap_mb, args, rank, w, steps=3):
    """torch's DDP at ``bucket_cap_mb=cap_mb``: per iteration the buckets its comm hook was handed,
    in launch order, and the order the gradients became ready."""
    model, ready, per_iteration = seeded(ToyModel, args.seed), [], []
    readiness(model, ready)
    wrapped = ddp(model, group, bucket_cap_mb=cap_mb)
    optimizer = sgd(wrapped)
    for step in range(steps):
        x, y = batch(args.seed, step, args.batch_size * w, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        ready.clear()
        loss(wrapped, x, y, rank, w).backward()
        optimizer.step()
        per_iteration.append({"launched": wrapped.bucket_log.take(), "ready": [n for _, n in ready]})
    return {"iterations": per_iteration}


class Timed:
    """One model of the timing lab, wrapped, with readiness hooks registered before any version's
    hooks, its optimizer, and one record per step."""

    def __init__(self, version, args, group, **ddp_kwargs):
        model, self.ready, self.records = timing_model(args.seed), [], []
        readiness(model, self.ready)
        self.model = (ddp(model, group, **ddp_kwargs) if version == "ddp"
                      else BucketDDP(model, TIMING_BUCKET_CAP_MB, group=group) if version == "bucket"
                      else VERSIONS[version](model, group=group))
        self.optimizer = sgd(self.model, lr=0.01)

    def step(self, step, args, rank, group):
        """One step's times: forward, backward, each gradient ready, synced, step end, each
        all-reduce; for torch's DDP also its buckets and its logger's overlap."""
        model, records = self.model, self.records
        x, y = batch(args.seed, 100 + step, args.batch_size * 2, 32, 5)
        self.optimizer.zero_grad(set_to_none=True)
        self.ready.clear()
        # Both ranks start together: a rank set back earlier by a shared CPU would make its peer wait
        # inside this step's all-reduces, and that wait is not communication.
        dist.barrier(group=group)
        with log.recording():
            t0 = time.perf_counter()
            out = loss(model, x, y, rank, 2)
            t1 = time.perf_counter()
            out.backward()
            sync(model)
            t3 = time.perf_counter()
        self.optimizer.step()
        record = {"forward": t0, "backward": t1, "synced": t3,
                  "step_end": time.perf_counter(), "ready": [t for t, _ in self.ready],
                  "all_reduces": [(c["launch"], c["done"], c["bytes"]) for c in log.take()
                                  if c["op"] == "all_reduce"]}
        if isinstance(model, DDP):
            record["buckets"] = [(b["bytes"], len(b["params"])) for b in model.bucket_log.take()]
            if step:  # DDP's logger takes an iteration's times at the next forward (logger.cpp
                # set_runtime_stats_and_log, from _pre_forward): now they are the previous step's
                data = model._get_ddp_logging_data()
                records[-1]["logger_overlap_ms"] = data["backward_compute_comm_overlap_time"] / 1e6
        records.append(record)


def timed(steps, args, rank, group, **ddp_kwargs):
    """torch's DDP alone on the timing model: its records of ``steps`` steps."""
    t = Timed("ddp", args, group, **ddp_kwargs)
    for step in range(steps):
        t.step(step, args, rank, group)
    return t.records


def part_overlap(args, rank, world_size):
    group = dist.new_group([0, 1])
    if rank > 1:
        return
    # The versions take turns, step by step: a burst of other work on a shared CPU falls on every
    # version's steps alike, not on the whole of one version's (each keeps its least exposed step).
    lab = {version: Timed(version, args, group) for version in (*VERSIONS, "ddp")}
    for step in range(args.timing_steps):
        for t in lab.values():
            t.step(step, args, rank, group)
    for version, t in lab.items():
        extra = {}
        if version == "bucket":
            extra["buckets"] = [[p.numel() * p.element_size() for p in b] for b in t.model.buckets]
        if version == "ddp":  # the running mean of DDP's logged overlap (ns)
            key = "avg_backward_compute_comm_overlap_time"
            extra[key] = t.model._get_ddp_logging_data().get(key)
        runfolder.report({"part": "overlap", "version": version, "steps": t.records, **extra})
    # DDP's first bucket of 1 MiB comes only with bucket_cap_mb=None: an explicit 25 has none
    cap25 = timed(2, args, rank, group, bucket_cap_mb=25)
    # find_unused_parameters=True, every parameter used: its cost per step, and its buckets (no
    # rebuild: reducer.hpp should_rebuild_buckets is false with find_unused_parameters)
    costs, unused_buckets = {}, {}
    for find in (False, True):
        with quiet_stderr() if find else contextlib.nullcontext():
            rec = timed(6, args, rank, group, find_unused_parameters=find)
        costs[str(find)] = [r["step_end"] - r["forward"] for r in rec[1:]]
        unused_buckets[str(find)] = rec[-1]["buckets"]
    runfolder.report({"part": "overlap_final",
                      "digests": {v: digest(t.model.parameters()) for v, t in lab.items()},
                      "find_unused_step_s": costs, "find_unused_buckets": unused_buckets,
                      "cap25_buckets": cap25[-1]["buckets"]})


def part_cases(args, rank, world_size, k=4):
    group = dist.new_group([0, 1])
    if rank > 1:
        return
    out, placement = {}, {}
    for version in ("overlap", "bucket", "ddp"):
        model = wrap(version, seeded(ToyModel, args.seed), group)
        optimizer, per_micro = sgd(model), []
        for micro in range(k):  # k micro-batches, all but the last inside no_sync()
            x, y = batch(args.seed, 200 + micro, args.batch_size * 2, 10, 5)
            with log.recording():
                with model.no_sync() if micro < k - 1 else contextlib.nullcontext():
                    (loss(model, x, y, rank, 2) / k).backward()
                if micro == k - 1:
                    sync(model)
            per_micro.append(sum(c["op"] == "all_reduce" for c in log.take()))
        optimizer.step()
        out[version] = {"all_reduces_per_micro_step": per_micro, "final": flat(model)}
        # Forward and backward on opposite sides of no_sync(): DDP decides in forward (distributed.py
        # _pre_forward and _post_forward read require_backward_grad_sync), a hook in backward.
        model = wrap(version, seeded(ToyModel, args.seed), group)
        x, y = batch(args.seed, 250, args.batch_size * 2, 10, 5)
        counts = {}
        for where in ("forward inside", "backward inside"):
            with log.recording():
                with model.no_sync() if where == "forward inside" else contextlib.nullcontext():
                    out_loss = loss(model, x, y, rank, 2)
                with model.no_sync() if where == "backward inside" else contextlib.nullcontext():
                    out_loss.backward()
            counts[where] = sum(c["op"] == "all_reduce" for c in log.take())
            if counts[where] and not isinstance(model, DDP):
                sync(model)  # the hooks launched all-reduces: wait for them
            model.zero_grad(set_to_none=True)
        placement[version] = counts
    # DDP's answer to a parameter that gets no gradient on one rank: only rank 0 takes the branch
    model = ddp(seeded(BranchModel, args.seed), group, find_unused_parameters=True)
    optimizer = sgd(model)
    for step in range(3):
        x, y = branch_batch(args.seed, step, rank, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    runfolder.report({"part": "cases", "no_sync": out, "k": k, "find_unused_steps": 3,
                      "find_unused_digest": digest(model.parameters()), "no_sync_placement": placement})


def part_hang(args, rank, world_size):
    # No optimizer: building one imports torch._dynamo (torch.optim wraps its methods in
    # torch._disable_dynamo), which the short deadline must not pay.
    model = BucketDDP(seeded(BranchModel, args.seed), bucket_cap_mb=CAPS[1])
    x, y = branch_batch(args.seed, 0, rank, args.batch_size)
    # From before backward: gloo's timeout runs from the all-reduce's launch, in a backward hook.
    t0 = time.perf_counter()
    F.mse_loss(model(x), y).backward()
    report = {"part": "hang", "took_branch": bool(x[0, 0] > 0),
              "gradients": sum(p.grad is not None for p in model.parameters()),
              "parameters": sum(1 for _ in model.parameters())}
    runfolder.report(report)
    try:
        # Rank 0's all-reduce waits for rank 1, which never launches that bucket, until gloo's
        # timeout (--pg-timeout). Rank 1 waits on its own bucket's Future, which nothing completes.
        model.finish_gradient_synchronization()
    except RuntimeError as exc:
        # Noted, and this rank ends, so that the notebook sees both: this error and the other rank
        # still waiting (a training script lets it raise, and a fail-fast launcher stops all).
        runfolder.report({**report, "error": str(exc).splitlines()[0],
                          "error_after_s": time.perf_counter() - t0})
        return
    raise AssertionError("finish_gradient_synchronization returned: a bucket was all-reduced with no peer")


if __name__ == "__main__":
    # 11 timing steps: 10 timed per rank after the warm-up one, and DDP's logger collects its times
    # only in iterations 1-10 (reducer.cpp should_collect_runtime_stats), read at the next forward.
    run_parts(__doc__, {part: globals()["part_" + part] for part in PARTS},
              "construct,exact,overlap,cases", steps=5, batch_size=8, timing_steps=11)
