"""DDP built by hand, measured against torch's on the same model and data, in one launch.

    python -c "import ddp_tutorial as d; d.launch('ddp_tutorial/lessons/build_ddp/workers/build_ddp_lab.py', 4)"

Parts (``--parts``, comma-separated; each reports records with ``part`` = its name):

- ``construct``: every rank builds the toy model from its own seed; each version
  (``my_ddps.py``) and torch's DDP must leave every rank with rank 0's weights.
- ``exact``: for W = 2, 3 and 4 (groups of ranks 0..W-1 within one launch), each
  version and torch's DDP train the toy model (tied weights, a frozen bias, a
  ``requires_grad=False`` parameter) for ``--steps`` SGD steps on the same
  batches; rank 0 adds one float64 process on the global batch. Also the
  all-reduces each version makes per step, and BucketDDP's buckets for three caps.
- ``overlap``: W = 2, the timing model (layers with a simulated GPU kernel in
  their backward); per version and DDP, per step: backward's span, when each
  gradient was ready, each all-reduce from launch to completion, the wait
  after backward, the step time; DDP's own logger; find_unused_parameters' cost.
- ``cases``: W = 2: no_sync accumulation (K micro-batches, one all-reduce round)
  against DDP's no_sync, and DDP's find_unused_parameters=True on a branch that
  only rank 0 takes.
- ``hang``: W = 2: BucketDDP on that branch. Rank 1 never gets the branch's
  gradient, so it waits for ever: run it under a short launch deadline.

Flags: ``--parts construct,exact,overlap,cases --steps 5 --batch-size 8 --seed 0``; ``--pg-timeout 60``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

if __package__ in (None, ""):  # run as a file path: make the package importable
    sys.path.insert(0, os.path.abspath(__file__).rsplit(os.sep + "ddp_tutorial" + os.sep, 1)[0])

from ddp_tutorial import runfolder  # noqa: E402
from ddp_tutorial.lessons.build_ddp.workers.my_ddps import (  # noqa: E402
    BucketDDP, FlatDDP, NaiveDDP, OverlapDDP, SimulatedGpuKernel)
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import digest, flags, generator, run, shard  # noqa: E402

PARTS = ("construct", "exact", "overlap", "cases", "hang")
LR = 0.1
#: BucketDDP caps (MiB) that cut the toy model's 2,132 trainable bytes into 1, 2 and 3 buckets.
CAPS = {1: 1.0, 2: 1500 / 2**20, 3: 1100 / 2**20}
VERSIONS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP,
            "bucket": lambda m, group=None: BucketDDP(m, CAPS[2], group=group)}
#: The timing model: widths, and the simulated GPU kernel's backward per layer (ms).
WIDE, KERNEL_MS = 384, 10.0


class ToyModel(nn.Module):
    """The cases a first DDP gets wrong: fc3 shares fc2's weight (tied), fc2's bias is frozen, and
    ``fixed`` is a parameter with requires_grad=False. 6 trainable tensors, 2,132 bytes."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(10, 16), nn.Linear(16, 16)
        self.fc3, self.out = nn.Linear(16, 16), nn.Linear(16, 5)
        self.fc3.weight = self.fc2.weight
        self.fc2.bias.requires_grad_(False)
        self.fixed = nn.Parameter(torch.randn(16), requires_grad=False)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.out(F.relu(self.fc3(x) + self.fixed))


class BranchModel(nn.Module):
    """A branch taken only for inputs whose first column is positive: its parameters may get no gradient."""

    def __init__(self):
        super().__init__()
        self.branch, self.body, self.out = nn.Linear(10, 10), nn.Linear(10, 16), nn.Linear(16, 5)

    def forward(self, x):
        if bool(x[0, 0] > 0):
            x = x + self.branch(x)
        return self.out(F.relu(self.body(x)))


def toy_model(seed):
    torch.manual_seed(seed)
    return ToyModel()


def timing_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(),
                         nn.Linear(WIDE, WIDE), SimulatedGpuKernel(KERNEL_MS), nn.ReLU(), nn.Linear(WIDE, 5))


def batch(seed, step, rows, d_in, d_out):
    g = generator(seed, step)
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


class Collectives:
    """Every dist.all_reduce and dist.broadcast made while recording: bytes, launch and completion times
    (perf_counter, this rank's clock; an async one completes when its future does, seen from gloo's thread)."""

    def __init__(self):
        self.calls, self.recording = [], False
        all_reduce, broadcast = dist.all_reduce, dist.broadcast

        def recorded(original, op):
            def call(tensor, *args, **kwargs):
                rec = {"op": op, "bytes": tensor.numel() * tensor.element_size(), "launch": time.perf_counter()}
                work = original(tensor, *args, **kwargs)
                if self.recording:
                    self.calls.append(rec)
                if work is None:
                    rec["done"] = time.perf_counter()
                else:
                    work.get_future().then(lambda _: rec.__setitem__("done", time.perf_counter()))
                return work
            return call

        dist.all_reduce, dist.broadcast = recorded(all_reduce, "all_reduce"), recorded(broadcast, "broadcast")

    def take(self):
        calls, self.calls = self.calls, []
        return calls

    def __enter__(self):
        self.recording = True
        return self

    def __exit__(self, *exc):
        self.recording = False


log = Collectives()


def ddp(model, group=None, **kwargs):
    """torch's DDP, its all-reduces through Python (allreduce_hook: the same arithmetic as its default) so
    the log sees them."""
    wrapped = DDP(model, process_group=group, **kwargs)
    wrapped.register_comm_hook(group, default_hooks.allreduce_hook)
    return wrapped


def wrap(version, model, group):
    return ddp(model, group) if version == "ddp" else VERSIONS[version](model, group=group)


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


# -- exact ---------------------------------------------------------------------
def train(model, optimizer, steps, seed, rank, world_size, rows_per_rank, record=False):
    per_step = []
    for step in range(steps):
        x, y = batch(seed, step, rows_per_rank * world_size, 10, 5)
        optimizer.zero_grad(set_to_none=True)
        with log:
            F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            sync(model)
        calls = log.take()
        per_step.append({"all_reduces": sum(c["op"] == "all_reduce" for c in calls),
                         "bytes": sum(c["bytes"] for c in calls if c["op"] == "all_reduce")})
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
        finals, steps = {}, {}
        for version in (*VERSIONS, "ddp"):
            model = wrap(version, toy_model(args.seed), group)
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            steps[version] = train(model, optimizer, args.steps, args.seed, rank, w, args.batch_size)
            finals[version] = flat_params(model)
            grads = {n: p.grad is not None for n, p in model.named_parameters()}
        buckets = {}
        for n, cap in CAPS.items():
            model = BucketDDP(toy_model(args.seed), cap, group=group)
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            names = {id(p): name for name, p in model.module.named_parameters()}
            buckets[n] = {"cap_mb": cap, "buckets": [[names[id(p)] for p in b] for b in model.buckets],
                          "per_step": train(model, optimizer, 2, args.seed, rank, w, args.batch_size)}
        record = {"part": "exact", "world_size": w, "finals": finals, "steps": steps, "buckets": buckets,
                  "has_grad": grads}
        if rank == 0:
            record["float64"] = float64_reference(args, w)
        runfolder.report(record)


# -- overlap -------------------------------------------------------------------
def timed_steps(model, steps, seed, rank, world_size, rows, group):
    """Per step: forward start, backward start, each gradient's ready time, backward end, synced, step end."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ready = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    records = []
    for step in range(steps):
        x, y = batch(seed, 100 + step, rows * world_size, 32, 5)
        optimizer.zero_grad(set_to_none=True)
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
        optimizer.step()
        t4 = time.perf_counter()
        calls = [c for c in log.take() if c["op"] == "all_reduce"]
        records.append({"forward": t0, "backward": t1, "backward_end": t2, "synced": t3, "step_end": t4,
                        "ready": list(ready), "all_reduces": [(c["launch"], c["done"], c["bytes"]) for c in calls]})
    return records


def part_overlap(args, rank, world_size):
    group = dist.new_group([0, 1])
    if rank > 1:
        return
    finals = {}
    for version in (*VERSIONS, "ddp"):
        model = wrap(version, timing_model(args.seed), group)
        records = timed_steps(model, args.timing_steps, args.seed, rank, 2, args.batch_size, group)
        finals[version] = digest(model.parameters())
        extra = {}
        if version == "ddp":
            data = model._get_ddp_logging_data()
            extra = {k: data.get(k) for k in ("avg_backward_compute_comm_overlap_time", "avg_backward_comm_time",
                                              "avg_backward_compute_time")}
        runfolder.report({"part": "overlap", "version": version, "steps": records, **extra})
    # find_unused_parameters=True on the same model, every parameter used: what the search costs per step
    costs = {}
    for find in (False, True):
        model = ddp(timing_model(args.seed), group, find_unused_parameters=find)
        rec = timed_steps(model, args.timing_steps, args.seed, rank, 2, args.batch_size, group)
        costs.setdefault(str(find), []).extend(r["step_end"] - r["forward"] for r in rec[1:])
    runfolder.report({"part": "overlap_final", "digests": finals, "find_unused_step_s": costs})


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
    # DDP's answer to a parameter that gets no gradient on one rank: only rank 0 takes the branch
    model = ddp(branch_model(args.seed), group, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        x, y = branch_batch(args.seed, step, rank, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    runfolder.report({"part": "cases", "no_sync": out, "k": k, "find_unused_digest": digest(model.parameters()),
                      "find_unused_steps": 3})


def branch_model(seed):
    torch.manual_seed(seed)
    return BranchModel()


def branch_batch(seed, step, rank, rows):
    """Rank 0's batches take the branch (first column positive), rank 1's never do."""
    x, y = batch(seed, 300 + 10 * step + rank, rows, 10, 5)
    x[0, 0] = abs(float(x[0, 0])) + 0.1 if rank == 0 else -abs(float(x[0, 0])) - 0.1
    return x, y


# -- hang ----------------------------------------------------------------------
def part_hang(args, rank, world_size):
    # No optimizer: the step is never reached, and building one imports torch._dynamo (about 2 CPU-s a
    # rank: torch.optim's methods are wrapped by torch._disable_dynamo), which the short deadline must not pay.
    model = BucketDDP(branch_model(args.seed), bucket_cap_mb=CAPS[1])
    x, y = branch_batch(args.seed, 0, rank, args.batch_size)
    F.mse_loss(model(x), y).backward()
    runfolder.report({"part": "hang", "took_branch": bool(x[0, 0] > 0),
                      "gradients": sum(p.grad is not None for p in model.parameters()),
                      "parameters": sum(1 for _ in model.parameters())})
    model.finish_gradient_synchronization()  # rank 1 waits here for the branch's gradient: for ever


def parser():
    p = flags(__doc__, steps=5, batch_size=8, timing_steps=6)
    p.add_argument("--parts", default="construct,exact,overlap,cases", help="comma-separated: " + ", ".join(PARTS))
    return p


def body(args, rank, world_size):
    wanted = [part for part in args.parts.split(",") if part]
    unknown = [part for part in wanted if part not in PARTS]
    if unknown:
        raise SystemExit(f"no part(s) {unknown}; the parts are {', '.join(PARTS)}")
    for part in wanted:
        globals()[f"part_{part}"](args, rank, world_size)


if __name__ == "__main__":
    sys.exit(run(body, parser()))
