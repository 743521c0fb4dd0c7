"""DDP built by hand, measured against torch's on the same model and data, in one launch.

    python -c "import ddp_tutorial as d; d.launch('ddp_tutorial/lessons/build_ddp/workers/build_ddp_lab.py', 4)"

Parts (``--parts``, comma-separated; each reports records with ``part`` = its name):

- ``construct``: every rank builds the toy model from its own seed; each version
  (``my_ddps.py``) and torch's DDP must leave every rank with rank 0's weights. Then a model
  with a buffer that each rank changes after construction: the value each forward sees.
- ``exact``: for W = 2, 3 and 4 (groups of ranks 0..W-1 within one launch), each
  version and torch's DDP train the toy model (tied weights, a frozen bias, a
  ``requires_grad=False`` parameter) for ``--steps`` SGD steps on the same
  batches (torch's DDP twice: with ``allreduce_hook``, whose all-reduces the log
  sees, and with its default C++ path); rank 0 adds one float64 process on the
  global batch. Also the all-reduces each version makes per step, and for three
  caps BucketDDP's buckets and the buckets torch's DDP launches in each iteration.
- ``overlap``: W = 2, the timing model (layers with a simulated GPU kernel in
  their backward); per version and DDP, per step: backward's span, when each
  gradient was ready, each all-reduce from launch to completion, the wait
  after backward, the step time; DDP's own logger and buckets per iteration;
  DDP with bucket_cap_mb=25 against None; find_unused_parameters' cost and buckets.
- ``cases``: W = 2: no_sync accumulation (K micro-batches, one all-reduce round)
  against DDP's no_sync; forward and backward on opposite sides of ``no_sync()``;
  DDP's find_unused_parameters=True on a branch that only rank 0 takes.
- ``hang``: W = 2: BucketDDP on that branch. Rank 1 never gets the branch's
  gradient, so it never launches that bucket and waits for ever; rank 0's
  all-reduce fails at the group's timeout (``--pg-timeout``): run it under a
  launch deadline longer than that timeout.

Flags: ``--parts construct,exact,overlap,cases --steps 5 --batch-size 8 --seed 0``; ``--pg-timeout 60``.
"""

import contextlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import runfolder
from ddp_tutorial.lessons.build_ddp.workers.lab_models import (
    ScaleModel, batch, branch_batch, branch_model, toy_model)
from ddp_tutorial.lessons.build_ddp.workers.lab_recording import ddp, log, quiet_stderr, readiness
from ddp_tutorial.lessons.build_ddp.workers.my_ddps import (
    BucketDDP, FlatDDP, NaiveDDP, OverlapDDP, SimulatedGpuKernel)
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import digest, flags, run, shard

PARTS = ("construct", "exact", "overlap", "cases", "hang")
LR = 0.1
#: Caps (MiB) that cut the toy model's 2,132 trainable bytes into 1, 2 and 3 buckets by BucketDDP's rule
#: (a bucket never passes the cap); by DDP's (a bucket closes once it reaches the cap) into 1, 1 and 2.
CAPS = {1: 1.0, 2: 1500 / 2**20, 3: 1100 / 2**20}
#: BucketDDP's cap on the timing model (1.2 MB of gradients in 8 tensors): buckets of several tensors.
TIMING_BUCKET_CAP_MB = 1.0
VERSIONS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP,
            "bucket": lambda m, group=None: BucketDDP(m, CAPS[2], group=group)}
#: The timing model: widths, and the simulated GPU kernel's backward per layer (ms).
WIDE, KERNEL_MS = 384, 10.0


def timing_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(), nn.Linear(WIDE, 5))


def wrap(version, model, group):
    if version == "ddp":
        return ddp(model, group)
    if version == "ddp_default":
        return ddp(model, group, hook=False)
    return VERSIONS[version](model, group=group)


def sync(model):
    """After backward: a hand-made DDP needs its call; torch's DDP synced inside backward."""
    if not isinstance(model, DDP):
        model.finish_gradient_synchronization()


def flat_params(model):
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


# -- construct -----------------------------------------------------------------
def part_construct(args, rank, world_size):
    rank0 = digest(toy_model(args.seed).parameters())  # what rank 0 builds from seed + 0
    for version in (*VERSIONS, "ddp"):
        model = toy_model(args.seed + rank)  # a different start on every rank
        before = digest(model.parameters())
        with log:
            wrapped = wrap(version, model, None)
        calls = log.take()
        runfolder.report({"part": "construct", "version": version, "before": before, "after": digest(
            [*wrapped.parameters(), *wrapped.buffers()]), "rank0_built": rank0,
            "broadcasts": sum(c["op"] == "broadcast" for c in calls)})
    # Buffers after construction: each rank sets its own, then one forward reads it. DDP broadcasts rank 0's
    # buffers before every forward (distributed.py ``_pre_forward`` -> ``_check_sync_bufs_pre_fwd`` ->
    # ``_sync_buffers``; ``broadcast_buffers``/``forward_sync_buffers``, on by default); the versions here
    # broadcast them only when they are built.
    for version in (*VERSIONS, "ddp"):
        model = ScaleModel()
        wrapped = wrap(version, model, None)
        with torch.no_grad():
            model.scale.fill_(rank + 1)
        seen = []
        handle = model.register_forward_pre_hook(lambda m, _: seen.append(float(m.scale)))
        with torch.no_grad():
            wrapped(torch.ones(2, 3))
        handle.remove()
        runfolder.report({"part": "buffers", "version": version, "set": rank + 1, "seen": seen[0]})


# -- exact ---------------------------------------------------------------------
def train(model, optimizer, steps, seed, rank, world_size, rows_per_rank, grads=None):
    """SGD steps; per step the all-reduces and their bytes. ``grads``: a list that gets the first step's
    averaged gradients (flat), as the optimizer reads them."""
    per_step = []
    for step in range(steps):
        x, y = batch(seed, step, rows_per_rank * world_size, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        with log:
            F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            sync(model)
        calls = log.take()
        per_step.append({"all_reduces": sum(c["op"] == "all_reduce" for c in calls),
                         "bytes": sum(c["bytes"] for c in calls if c["op"] == "all_reduce"),
                         "seconds": [c["done"] - c["launch"] for c in calls if c["op"] == "all_reduce"]})
        if grads is not None and step == 0:
            grads.extend(float(v) for p in model.parameters() if p.grad is not None for v in p.grad.reshape(-1))
        optimizer.step()
    return per_step


def float64_reference(args, world_size):
    """One process on the global batch, in float64: the size of float32's rounding."""
    model = toy_model(args.seed).double()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(args.steps):
        x, y = batch(args.seed, step, args.batch_size * world_size, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x.double()), y.double()).backward()
        optimizer.step()
    return flat_params(model)


def part_exact(args, rank, world_size):
    for w in (2, 3, 4):
        if w > world_size:
            continue
        group = dist.new_group(list(range(w)))  # every rank takes part in creating it
        if rank >= w:
            continue
        finals, steps, first_grads = {}, {}, {"ddp": [], "ddp_default": []}
        for version in (*VERSIONS, "ddp", "ddp_default"):
            model = wrap(version, toy_model(args.seed), group)
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            steps[version] = train(model, optimizer, args.steps, args.seed, rank, w, args.batch_size,
                                   first_grads.get(version))
            finals[version] = flat_params(model)
            grads = {n: p.grad is not None for n, p in model.named_parameters()}
        buckets = {}
        for n, cap in CAPS.items():
            model = BucketDDP(toy_model(args.seed), cap, group=group)
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            names = {id(p): name for name, p in model.module.named_parameters()}
            buckets[n] = {"cap_mb": cap, "buckets": [[names[id(p)] for p in b] for b in model.buckets],
                          "per_step": train(model, optimizer, 2, args.seed, rank, w, args.batch_size)}
            if w == 2:
                buckets[n]["ddp"] = ddp_iterations(toy_model(args.seed), group, cap, args, rank, w)
        record = {"part": "exact", "world_size": w, "finals": finals, "steps": steps, "buckets": buckets,
                  "has_grad": grads, "first_grads": first_grads}
        if rank == 0:
            record["float64"] = float64_reference(args, w)
        runfolder.report(record)


def ddp_iterations(model, group, cap_mb, args, rank, w, steps=3):
    """torch's DDP at ``bucket_cap_mb=cap_mb``, ``steps`` iterations: per iteration the buckets its comm hook
    was handed, in launch order, and the order the gradients became ready; then its logger's bucket sizes."""
    ready = []
    readiness(model, ready)
    wrapped = ddp(model, group, bucket_cap_mb=cap_mb)
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
    per_iteration = []
    for step in range(steps):
        x, y = batch(args.seed, step, args.batch_size * w, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        ready.clear()
        F.mse_loss(wrapped(shard(x, rank, w)), shard(y, rank, w)).backward()
        optimizer.step()
        per_iteration.append({"launched": wrapped.bucket_log.take(), "ready": [n for _, n in ready]})
    data = wrapped._get_ddp_logging_data()
    return {"iterations": per_iteration, "bucket_sizes": data.get("bucket_sizes"),
            "rebuilt_bucket_sizes": data.get("rebuilt_bucket_sizes")}


# -- overlap -------------------------------------------------------------------
class Timed:
    """One model of the timing lab: wrapped, with readiness hooks (registered before any version's hooks),
    its optimizer, and one record per step."""

    def __init__(self, version, args, group, **ddp_kwargs):
        model, self.ready, self.records = timing_model(args.seed), [], []
        readiness(model, self.ready)
        if version == "ddp":
            self.model = ddp(model, group, **ddp_kwargs)
        elif version == "bucket":
            self.model = BucketDDP(model, TIMING_BUCKET_CAP_MB, group=group)
        else:
            self.model = VERSIONS[version](model, group=group)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def step(self, step, args, rank, group, world_size=2):
        """One step: forward start, backward start, each gradient's ready time, backward end, synced, step end,
        each all-reduce; for torch's DDP also the buckets it launched and its logger's overlap."""
        model, ready, records = self.model, self.ready, self.records
        x, y = batch(args.seed, 100 + step, args.batch_size * world_size, 32, 5)
        self.optimizer.zero_grad(set_to_none=True)
        ready.clear()
        # Both ranks start the step together: a rank that a shared CPU set back in an earlier step would
        # otherwise make its peer wait inside this step's all-reduces, and that wait is not communication.
        dist.barrier(group=group)
        with log:
            t0 = time.perf_counter()
            loss = F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            sync(model)
            t3 = time.perf_counter()
        self.optimizer.step()
        t4 = time.perf_counter()
        calls = [c for c in log.take() if c["op"] == "all_reduce"]
        record = {"forward": t0, "backward": t1, "backward_end": t2, "synced": t3, "step_end": t4,
                  "ready": [t for t, _ in ready], "all_reduces": [(c["launch"], c["done"], c["bytes"]) for c in calls]}
        if isinstance(model, DDP):
            record["buckets"] = [(b["bytes"], len(b["params"])) for b in model.bucket_log.take()]
            if step:  # DDP's logger takes an iteration's times at the next forward (logger.cpp
                # set_runtime_stats_and_log, called from _pre_forward): now they are the previous step's
                data = model._get_ddp_logging_data()
                records[-1]["logger_overlap_ms"] = data["backward_compute_comm_overlap_time"] / 1e6
        records.append(record)


def timed(version, args, rank, group, steps=None, **ddp_kwargs):
    """One version alone, ``steps`` steps (``--timing-steps`` by default)."""
    t = Timed(version, args, group, **ddp_kwargs)
    for step in range(steps or args.timing_steps):
        t.step(step, args, rank, group)
    return t.model, t.records


def part_overlap(args, rank, world_size):
    group = dist.new_group([0, 1])
    if rank > 1:
        return
    # The versions take turns, step by step: a burst of other work on a shared CPU then falls on every
    # version's steps alike, not on the whole of one version's (each keeps its least exposed step).
    lab = {version: Timed(version, args, group) for version in (*VERSIONS, "ddp")}
    for step in range(args.timing_steps):
        for t in lab.values():
            t.step(step, args, rank, group)
    finals = {}
    for version, t in lab.items():
        model, records = t.model, t.records
        finals[version] = digest(model.parameters())
        extra = {}
        if version == "bucket":
            extra["buckets"] = [[p.numel() * p.element_size() for p in b] for b in model.buckets]
        if version == "ddp":
            data = model._get_ddp_logging_data()
            extra = {k: data.get(k) for k in ("avg_backward_compute_comm_overlap_time", "avg_backward_comm_time",
                                              "avg_backward_compute_time")}
        runfolder.report({"part": "overlap", "version": version, "steps": records, **extra})
    # DDP's first bucket of 1 MiB comes only with bucket_cap_mb=None: an explicit 25 has none
    _, cap25 = timed("ddp", args, rank, group, steps=2, bucket_cap_mb=25)
    # find_unused_parameters=True on the same model, every parameter used: what it costs per step, and its
    # buckets (no rebuild: reducer.hpp should_rebuild_buckets is false with find_unused_parameters)
    costs, unused_buckets = {}, {}
    for find in (False, True):
        with quiet_stderr() if find else contextlib.nullcontext():
            _, rec = timed("ddp", args, rank, group, steps=6, find_unused_parameters=find)
        costs[str(find)] = [r["step_end"] - r["forward"] for r in rec[1:]]
        unused_buckets[str(find)] = rec[-1]["buckets"]
    runfolder.report({"part": "overlap_final", "digests": finals, "find_unused_step_s": costs,
                      "find_unused_buckets": unused_buckets, "cap25_buckets": cap25[-1]["buckets"]})


# -- cases ---------------------------------------------------------------------
def part_cases(args, rank, world_size):
    group = dist.new_group([0, 1])
    if rank > 1:
        return
    k = 4
    out = {}
    for version in ("overlap", "bucket", "ddp"):
        model = wrap(version, toy_model(args.seed), group)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        per_micro = []
        for micro in range(k):
            x, y = batch(args.seed, 200 + micro, args.batch_size * 2, 10, 5)
            last = micro == k - 1
            with log:
                if last:
                    (F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2)) / k).backward()
                    sync(model)
                else:
                    with model.no_sync():
                        (F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2)) / k).backward()
            per_micro.append(sum(c["op"] == "all_reduce" for c in log.take()))
        optimizer.step()
        out[version] = {"all_reduces_per_micro_step": per_micro, "final": flat_params(model)}
    # Forward and backward on opposite sides of no_sync(): DDP decides in forward (distributed.py
    # ``_pre_forward``/``_post_forward`` read ``require_backward_grad_sync``), a hook-based version in backward.
    placement = {}
    for version in ("overlap", "bucket", "ddp"):
        model = wrap(version, toy_model(args.seed), group)
        x, y = batch(args.seed, 250, args.batch_size * 2, 10, 5)
        counts = {}
        for where in ("forward inside", "backward inside"):
            with log:
                if where == "forward inside":
                    with model.no_sync():
                        loss = F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2))
                    loss.backward()
                else:
                    loss = F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2))
                    with model.no_sync():
                        loss.backward()
            counts[where] = sum(c["op"] == "all_reduce" for c in log.take())
            if counts[where] and not isinstance(model, DDP):
                sync(model)  # the hooks launched all-reduces: wait for them
            model.zero_grad(set_to_none=True)
        placement[version] = counts
    # DDP's answer to a parameter that gets no gradient on one rank: only rank 0 takes the branch
    model = ddp(branch_model(args.seed), group, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        x, y = branch_batch(args.seed, step, rank, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    runfolder.report({"part": "cases", "no_sync": out, "k": k, "find_unused_digest": digest(model.parameters()),
                      "find_unused_steps": 3, "no_sync_placement": placement})


# -- hang ----------------------------------------------------------------------
def part_hang(args, rank, world_size):
    # No optimizer: the step is never reached, and building one imports torch._dynamo (about 2 CPU-s a
    # rank: torch.optim's methods are wrapped by torch._disable_dynamo), which the short deadline must not pay.
    model = BucketDDP(branch_model(args.seed), bucket_cap_mb=CAPS[1])
    x, y = branch_batch(args.seed, 0, rank, args.batch_size)
    F.mse_loss(model(x), y).backward()
    report = {"part": "hang", "took_branch": bool(x[0, 0] > 0),
              "gradients": sum(p.grad is not None for p in model.parameters()),
              "parameters": sum(1 for _ in model.parameters())}
    runfolder.report(report)
    t0 = time.perf_counter()
    try:
        # Rank 0 launched its bucket: its all-reduce waits for rank 1, which never launches that bucket,
        # until gloo's timeout (the group's, --pg-timeout). Rank 1 waits on its own bucket's Future, which
        # nothing will ever complete: no timeout applies to it.
        model.finish_gradient_synchronization()
    except RuntimeError as exc:
        # The lab notes rank 0's error and ends this rank, so that the notebook sees both ranks: this one's
        # error and the other still waiting. (A training script lets it raise; a fail-fast launcher then
        # stops every rank at once.)
        runfolder.report({**report, "error": str(exc).splitlines()[0], "error_after_s": time.perf_counter() - t0})
        return
    raise AssertionError("finish_gradient_synchronization returned: a bucket was all-reduced with no peer")


def parser():
    # 11 timing steps: 10 timed per rank after the warm-up one, each a chance for an undisturbed step; and DDP's
    # logger collects its times only in iterations 1-10 (then every sample_rate-th; reducer.cpp
    # should_collect_runtime_stats), the ones read here at the next step's forward.
    p = flags(__doc__, steps=5, batch_size=8, timing_steps=11)
    p.add_argument("--parts", default="construct,exact,overlap,cases", help="comma-separated: " + ", ".join(PARTS))
    return p


def body(args, rank, world_size):
    wanted = [part for part in args.parts.split(",") if part]
    unknown = [part for part in wanted if part not in PARTS]
    if unknown:
        raise SystemExit(f"no part(s) {unknown}; the parts are {', '.join(PARTS)}")
    for part in wanted:
        t0 = time.perf_counter()
        globals()[f"part_{part}"](args, rank, world_size)
        if rank == 0 and part != "hang":  # progress, echoed live by run_lab
            print(f"{part}: done in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(run(body, parser()))
