"""The harness of exercise "my_ddp": the learner's ``MyDDP`` class against torch's DDP, measured on this rank.

    python rank/bootstrap.py my_ddp_harness.py my_ddp SCRIPT

Loads SCRIPT as a module (its ``MyDDP``), joins the group ``launch`` set up, and
runs, beside ``DistributedDataParallel`` on the same model and batches:

- ``construct``: the model built from this rank's own seed, then wrapped: the
  digest of its parameters (must become rank 0's), and the broadcasts made;
- ``train`` for each bucket cap of ``CAPS`` (1, 2 and 3 buckets of the toy model):
  ``STEPS`` SGD steps; every all-reduce the class launches (its size, which
  tensor: a gradient, a parameter's data, or another buffer, whether it was
  launched before backward's last gradient, whether its handle was waited for,
  whether its tensor changed between launch and wait), the step-0 gradients'
  ratio to DDP's, the final parameters and DDP's;
- ``no_sync``: ``K`` micro-batches, the first K-1 inside ``no_sync()``: the
  all-reduces per micro-batch, the final parameters and DDP's.

Each all-reduce is reported the moment it is launched (``launch``), so a rank
that hangs or aborts leaves its sequence behind. Errors are reported
(``error``) and then raised: the rank fails as the learner's code did.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import runpy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.rank import bootstrap
from ddp_tutorial.runfolder import report

# This module runs the learner's code for the rank: its frames are not the script's.
globals()[bootstrap.RUNS_THE_SCRIPT] = True

#: Bucket caps (MiB) that cut the toy model's 2,132 trainable bytes into 1, 2 and 3 buckets.
CAPS = {1: 1.0, 2: 1500 / 2**20, 3: 1100 / 2**20}
STEPS, K, LR, ROWS = 3, 3, 0.1, 4


class ToyModel(nn.Module):
    """fc3 shares fc2's weight (tied), fc2's bias is frozen, ``fixed`` has requires_grad=False."""

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


def toy(seed: int) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel()


def rank_batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(ROWS * world_size, 10, generator=g), torch.randn(ROWS * world_size, 5, generator=g)
    return x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def flat(model) -> list:
    return [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]


class WatchedWork:
    """An async all-reduce's handle as the learner gets it: notes whether, and when, it was waited for."""

    def __init__(self, work, rec, tensor):
        self._work, self._rec, self._tensor = work, rec, tensor

    def wait(self, *args, **kwargs):
        self._rec["changed_before_wait"] = self._tensor._version != self._rec["version"]
        self._rec["waited"] = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._rec["waited"] = True  # a future the learner waits for, or chains: handled
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


class Watch:
    """Every dist.all_reduce and dist.broadcast of the learner's class, while ``case`` is set."""

    def __init__(self):
        self.case, self.step, self.calls, self.broadcasts = None, None, [], 0
        self.params, self.last_grad = [], 0.0
        self._all_reduce, self._broadcast = dist.all_reduce, dist.broadcast
        dist.all_reduce, dist.broadcast = self.all_reduce, self.broadcast

    def kind(self, tensor) -> str:
        ptr = tensor.data_ptr()
        if any(p.data_ptr() == ptr for p in self.params):
            return "param"
        if any(p.grad is not None and p.grad.data_ptr() == ptr for p in self.params):
            return "grad"
        return "buffer"

    def all_reduce(self, tensor, *args, **kwargs):
        rec = {"bytes": tensor.numel() * tensor.element_size(), "kind": self.kind(tensor),
               "launch": time.perf_counter(), "version": tensor._version, "waited": False,
               "async": bool(kwargs.get("async_op")), "tensor": tensor}
        if self.case is not None:
            self.calls.append(rec)
            report({"event": "launch", "case": self.case, "step": self.step, "bytes": rec["bytes"]})
        work = self._all_reduce(tensor, *args, **kwargs)
        return WatchedWork(work, rec, tensor) if work is not None else None

    def broadcast(self, tensor, *args, **kwargs):
        self.broadcasts += 1
        return self._broadcast(tensor, *args, **kwargs)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def grad_ratio(mine, ddp) -> float:
    """How the class's averaged gradients compare with DDP's: 1 right, W not divided, 1/W divided twice."""
    ratios = []
    for a, b in zip(mine, ddp):
        if a is not None and b is not None and float((b * b).sum()) > 0:
            ratios.append(float((a * b).sum() / (b * b).sum()))
    return statistics.median(ratios) if ratios else float("nan")


def sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def case_construct(MyDDP, watch, rank):
    model = toy(seed=rank)  # every rank starts different: the class must make them equal
    watch.params = list(model.parameters())
    watch.broadcasts = 0
    watch.case = "construct"
    registered = []
    original = torch.Tensor.register_post_accumulate_grad_hook

    def counted(tensor, hook):  # on any tensor: the module's parameters, or another model's
        registered.append(tensor)
        return original(tensor, hook)

    torch.Tensor.register_post_accumulate_grad_hook = counted
    try:
        wrapped = MyDDP(model)
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = original
        watch.case = None
    hooked = sum(bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in model.parameters())
    report({"event": "construct", "after": digest(model.parameters()), "rank0": digest(toy(0).parameters()),
            "broadcasts": watch.broadcasts, "hooked_params": hooked, "hooks_registered": len(registered),
            "module_kept": getattr(wrapped, "module", None) is model})


def case_train(MyDDP, watch, rank, world_size, n):
    model, reference = toy(0), DDP(toy(0))
    wrapped = MyDDP(model, bucket_cap_mb=CAPS[n])
    watch.params = list(model.parameters())
    ready = []
    for p in model.parameters():
        if p.requires_grad:  # after the class's own hooks: the moment the last one ran
            p.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    opt, ref_opt = (sgd(m) for m in (model, reference))
    steps, ratio = [], None
    for step in range(STEPS):
        x, y = rank_batch(step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        ready.clear()
        watch.case, watch.step = f"train{n}", step
        F.mse_loss(wrapped(x), y).backward()
        wrapped.finish_gradient_synchronization()
        watch.case = None
        calls = watch.take()
        last = max(ready) if ready else float("inf")
        steps.append({"all_reduces": [c["bytes"] for c in calls], "kinds": sorted({c["kind"] for c in calls}),
                      "launched_in_backward": sum(c["launch"] < last for c in calls),
                      "not_waited": sum(c["async"] and not c["waited"] for c in calls),
                      # Only an async all-reduce can race with the script: a blocking one has finished
                      # (writing its tensor) when it returns, and what the script does next is no race.
                      "changed_after_launch": sum(c["async"] and c.get("changed_before_wait",
                                                                       c["tensor"]._version != c["version"])
                                                  for c in calls)})
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(reference(x), y).backward()
        if step == 0:
            ratio = grad_ratio(grads(model), grads(reference.module))
        opt.step()
        ref_opt.step()
    report({"event": "train", "buckets": n, "steps": steps, "grad_ratio": ratio, "final": flat(model),
            "ddp_final": flat(reference.module)})


def case_no_sync(MyDDP, watch, rank, world_size):
    model, reference = toy(0), DDP(toy(0))
    wrapped = MyDDP(model)
    watch.params = list(model.parameters())
    opt, ref_opt = (sgd(m) for m in (model, reference))
    counts = []
    for micro in range(K):
        x, y = rank_batch(100 + micro, rank, world_size)
        watch.case, watch.step = "no_sync", micro
        if micro < K - 1:
            with wrapped.no_sync():
                (F.mse_loss(wrapped(x), y) / K).backward()
            with reference.no_sync():
                (F.mse_loss(reference(x), y) / K).backward()
        else:
            (F.mse_loss(wrapped(x), y) / K).backward()
            wrapped.finish_gradient_synchronization()
            (F.mse_loss(reference(x), y) / K).backward()
        watch.case = None
        counts.append(len(watch.take()))
    opt.step()
    ref_opt.step()
    report({"event": "no_sync", "all_reduces": counts, "final": flat(model), "ddp_final": flat(reference.module)})


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py my_ddp_harness.py my_ddp SCRIPT")
    torch.set_num_threads(1)
    script = os.path.abspath(argv[1])
    report({"event": "start", "exercise": argv[0], "pid": os.getpid()})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    watch = Watch()
    try:
        namespace = runpy.run_path(script, run_name="my_ddp")  # a module: its `if __name__ == "__main__"` stays out
        if "MyDDP" not in namespace:
            raise NameError(f"{os.path.basename(script)} defines no class MyDDP")
        MyDDP = namespace["MyDDP"]
        case_construct(MyDDP, watch, rank)
        for n in CAPS:
            case_train(MyDDP, watch, rank, world_size, n)
        case_no_sync(MyDDP, watch, rank, world_size)
        report({"event": "final", "exit_code": 0, "error": None})
    except BaseException as exc:
        report({"event": "final", "exit_code": 1, "case": watch.case,
                "error": {"type": type(exc).__name__, "message": str(exc)[:600], "where": None, "traceback": []}})
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
