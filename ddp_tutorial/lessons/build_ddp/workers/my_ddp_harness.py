"""Exercise "my_ddp"'s harness (``bootstrap.py my_ddp_harness.py my_ddp SCRIPT``): the learner's
``MyDDP`` beside torch's DDP (on a group of its own) on this rank; reports ``construct``, ``train``
per cap, ``no_sync``, ``unused``, and each collective (``my_ddp_watch.py``). A gradient counts as
produced in a tensor hook registered before the class's: a leaf's tensor hooks run before its
post-accumulate-grad hooks (``torch/_tensor.py``). Errors are reported, then raised."""

from __future__ import annotations

import datetime
import os
import runpy
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.build_ddp.workers.my_ddp_watch import Lockstep, Watch, summary
from ddp_tutorial.lessons.build_ddp.workers import lab_models
from ddp_tutorial.lessons.build_ddp.workers.lab_models import flat, seeded, sgd
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import digest
from ddp_tutorial.rank import bootstrap
from ddp_tutorial.runfolder import report

# This module runs the learner's code for the rank: its frames are not the script's.
globals()[bootstrap.RUNS_THE_SCRIPT] = True

#: Bucket caps in bytes (bucket_cap_mb = bytes / 2**20): 1 MiB holds the toy model's 2,132 trainable
#: bytes; 900 and 500 cut them into 2-4 buckets whatever the order and rule, never 1 or 6 (one each).
CAP_BYTES = (2**20, 900, 500)
STEPS, K, ROWS = 3, 3, 4


class ToyModel(lab_models.ToyModel):
    """Notebook 11's toy model and a buffer, ``shift``, drawn from the seed: it differs per rank."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.randn(5))

    def forward(self, x):
        return super().forward(x) + self.shift


class UnusedToyModel(ToyModel):
    """The toy model with a trainable parameter, ``spare``, that no forward uses."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.randn(4))


def rank_batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(ROWS * world_size, 10, generator=g), torch.randn(ROWS * world_size, 5, generator=g)
    return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def grad_ratio(mine, ddp) -> float:
    """How the class's averaged gradients compare with DDP's: 1 right, W not divided, 1/W divided twice."""
    ratios = [float((a * b).sum() / (b * b).sum()) for a, b in zip(mine, ddp)
              if a is not None and b is not None and float((b * b).sum()) > 0]
    return statistics.median(ratios) if ratios else float("nan")


def max_gap(mine, other) -> float:
    gaps = [float((a - b).abs().max()) for a, b in zip(mine, other) if a is not None and b is not None]
    return max(gaps) if gaps else float("nan")


def grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in trainable(model)]


def beside_ddp(MyDDP, watch, lockstep, ref_group, name, cls=ToyModel, ddp_kwargs=None, **kwargs):
    """The toy model (``cls``) in MyDDP, and torch's DDP on another copy, each with its SGD; each
    gradient counted as produced by a tensor hook registered before the class's hooks."""
    model, reference = seeded(cls, 0), DDP(seeded(cls, 0), process_group=ref_group, **(ddp_kwargs or {}))
    watch.params = list(model.parameters())
    for p in trainable(model):
        p.register_hook(lambda grad, key=id(p): watch.produced.add(key))
    with lockstep.segment(name):
        wrapped = MyDDP(model, **kwargs)
    watch.take()
    return model, reference, wrapped, sgd(model), sgd(reference)


def one_step(wrapped, watch, lockstep, name, x, y, scale=1.0, finish=True):
    watch.produced.clear()
    with lockstep.segment(name):
        loss = F.mse_loss(wrapped(x), y) * scale
        watch.in_backward = True
        try:
            loss.backward()
        finally:
            watch.in_backward = False
        if finish:
            wrapped.finish_gradient_synchronization()
    return summary(watch.take(), len(watch.produced))


def case_construct(MyDDP, watch, lockstep, rank):
    model = seeded(ToyModel, rank)  # every rank starts different: the class must make them equal
    watch.params = list(model.parameters())
    registered = []
    original = torch.Tensor.register_post_accumulate_grad_hook

    def counted(tensor, hook):  # on any tensor: the module's parameters, or another model's
        registered.append(tensor)
        return original(tensor, hook)

    torch.Tensor.register_post_accumulate_grad_hook = counted
    try:
        with lockstep.segment("construction"):
            wrapped = MyDDP(model)
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = original
    calls = watch.take()
    hooked = sum(bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in model.parameters())
    rank0 = seeded(ToyModel, 0)
    own = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    on_module = sum(c["op"] == "broadcast" and "tensor" in c and c["tensor"].data_ptr() in own for c in calls)
    report({"event": "construct", "broadcasts_on_module": on_module, "after": digest(model.parameters()), "rank0": digest(rank0.parameters()),
            "buffers_after": digest(model.buffers()), "buffers_rank0": digest(rank0.buffers()),
            "buffers": [name for name, _ in model.named_buffers()],
            "broadcasts": sum(c["op"] == "broadcast" for c in calls), "collectives": [c["op"] for c in calls],
            "hooked_params": hooked, "hooks_registered": len(registered),
            "module_kept": getattr(wrapped, "module", None) is model})


def case_train(MyDDP, watch, lockstep, ref_group, rank, world_size, cap):
    local = seeded(ToyModel, 0)
    model, reference, wrapped, opt, ref_opt = beside_ddp(
        MyDDP, watch, lockstep, ref_group, f"construction (cap {cap} bytes)",
        bucket_cap_mb=cap / 2**20)
    steps, ratio, gaps = [], None, {}
    for step in range(STEPS):
        x, y = rank_batch(step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        steps.append(one_step(wrapped, watch, lockstep, f"step {step} (cap {cap} bytes)", x, y))
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(reference(x), y).backward()
        if step == 0:
            F.mse_loss(local(x), y).backward()  # this rank's own gradient: what an unsynchronised class leaves
            ratio = grad_ratio(grads(model), grads(reference.module))
            gaps = {"to_local": max_gap(grads(model), grads(local)),
                    "to_local_over_w": max_gap(grads(model), [g / world_size for g in grads(local)]),
                    "local_to_ddp": max_gap(grads(local), grads(reference.module))}
        opt.step()
        ref_opt.step()
    report({"event": "train", "cap": cap, "steps": steps, "grad_ratio": ratio, "gaps": gaps,
            "param_bytes": [p.numel() * p.element_size() for p in trainable(model)],
            "final": flat(model), "ddp_final": flat(reference.module)})


def case_no_sync(MyDDP, watch, lockstep, ref_group, rank, world_size):
    model, reference, wrapped, opt, ref_opt = beside_ddp(MyDDP, watch, lockstep, ref_group,
                                                         "construction (no_sync)")
    counts = []
    for micro in range(K):
        x, y = rank_batch(100 + micro, rank, world_size)
        name = f"no_sync micro-batch {micro}"
        if micro < K - 1:
            with wrapped.no_sync():
                s = one_step(wrapped, watch, lockstep, name, x, y, scale=1 / K, finish=False)
            with reference.no_sync():
                (F.mse_loss(reference(x), y) / K).backward()
        else:
            s = one_step(wrapped, watch, lockstep, name, x, y, scale=1 / K)
            (F.mse_loss(reference(x), y) / K).backward()
        counts.append(len([op for op in s["ops"] if op == "all_reduce"]))
    opt.step()
    ref_opt.step()
    report({"event": "no_sync", "all_reduces": counts, "final": flat(model), "ddp_final": flat(reference.module)})


def case_unused(MyDDP, watch, lockstep, ref_group, rank, world_size):
    """Two steps of a model with a parameter no forward uses; the class's own error is caught and reported."""
    model, reference, wrapped, opt, ref_opt = beside_ddp(
        MyDDP, watch, lockstep, ref_group, "construction (unused parameter)", cls=UnusedToyModel,
        ddp_kwargs={"find_unused_parameters": True})
    raised, steps = None, []
    for step in range(2):
        x, y = rank_batch(200 + step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        watch.produced.clear()
        with lockstep.segment(f"step {step} (unused parameter)"):
            try:
                F.mse_loss(wrapped(x), y).backward()
                wrapped.finish_gradient_synchronization()
            except Exception as exc:  # what the exercise asks for: an error, on every rank
                raised = {"step": step, "type": type(exc).__name__, "message": str(exc)[:300]}
        steps.append(summary(watch.take(), len(watch.produced)))
        if raised:
            break
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(reference(x), y).backward()
        opt.step()
        ref_opt.step()
    report({"event": "unused", "raised": raised, "steps": steps, "final": flat(model),
            "ddp_final": flat(reference.module),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable(model))})


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py my_ddp_harness.py my_ddp SCRIPT")
    torch.set_num_threads(1)
    script = os.path.abspath(argv[1])
    report({"event": "start", "exercise": argv[0], "pid": os.getpid()})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ref_group = dist.new_group(backend="gloo")  # DDP's: its collectives never meet the class's
    lockstep = Lockstep(dist.distributed_c10d._get_default_store(), rank, world_size)
    watch = Watch(lockstep)
    try:
        namespace = runpy.run_path(script, run_name="my_ddp")  # a module: its `if __name__ == "__main__"` stays out
        if "MyDDP" not in namespace:
            raise NameError(f"{os.path.basename(script)} defines no class MyDDP")
        MyDDP = namespace["MyDDP"]
        case_construct(MyDDP, watch, lockstep, rank)
        for cap in CAP_BYTES:
            case_train(MyDDP, watch, lockstep, ref_group, rank, world_size, cap)
        case_no_sync(MyDDP, watch, lockstep, ref_group, rank, world_size)
        case_unused(MyDDP, watch, lockstep, ref_group, rank, world_size)
        report({"event": "final", "exit_code": 0, "error": None})
    except BaseException as exc:
        report({"event": "final", "exit_code": 1, "case": lockstep.last,
                "error": {"type": type(exc).__name__, "message": str(exc)[:600], "where": None, "traceback": []}})
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
