"""Where DDP keeps the gradients: beside the buckets, or in them (``gradient_as_bucket_view``).

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('perf_grad_view.py'), 2)"

By default every ``.grad`` is a tensor of its own, copied into its bucket before the all-reduce
and back after it; with ``DDP(model, gradient_as_bucket_view=True)`` each ``.grad`` is a view
into its bucket. An 8-layer MLP of width 256 (about 1.9 MB of gradients) is wrapped both ways,
each with ``zero_grad(set_to_none=...)`` both ways. Per setting, rank 0 reports the storages
behind the ``.grad`` tensors, the gradient bytes inside a bucket (a comm hook that all-reduces
like DDP's default one records the buckets' storages), the gradient and bucket bytes, and the
median step time of the settings taking turns step by step (``--steps`` each).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.performance.workers.perf_ddp import deep_model
from ddp_tutorial.runfolder import report

SETTINGS = [(False, True), (True, True), (False, False), (True, False)]  # (view, set_to_none)


def record_bucket(storages: dict, bucket):
    """A comm hook: averages like DDP's default one, and records the bucket's storage."""
    buffer = bucket.buffer()
    storages[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def make(view: bool):
    torch.manual_seed(0)
    model, storages = DDP(deep_model(width=256, depth=7), gradient_as_bucket_view=view), {}
    model.register_comm_hook(storages, record_bucket)
    return model, storages, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model, optimizer, x, y, set_to_none: bool) -> float:
    t0 = time.perf_counter()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return time.perf_counter() - t0


def where_grads_live(model, storages: dict) -> dict:
    grads = [p.grad for p in model.parameters()]
    nbytes = {g.untyped_storage().data_ptr(): g.numel() * g.element_size() for g in grads}
    return {"grad_storages": len(nbytes), "buckets": len(storages),
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "bucket_bytes": sum(storages.values()),
            "grad_bytes_inside_buckets": sum(g.numel() * g.element_size() for g in grads
                                             if g.untyped_storage().data_ptr() in storages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        x, y = torch.randn(32, 10), torch.randn(32, 20)
        runs = {setting: make(setting[0]) for setting in SETTINGS}
        times = {setting: [] for setting in SETTINGS}
        for i in range(steps + 3):  # the settings take turns, so load hits them alike
            for (view, none), (model, _, optimizer) in runs.items():
                seconds = step(model, optimizer, x, y, none)
                if i >= 3:  # the first steps build and rebuild the buckets
                    times[(view, none)].append(seconds)
        rows = []
        for (view, none), (model, storages, _) in runs.items():
            storages.clear()  # only this backward's buckets (the first one had a single bucket)
            nn.functional.mse_loss(model(x), y).backward()  # leave .grad in place to inspect it
            rows.append({"gradient_as_bucket_view": view, "set_to_none": none,
                         "step_s": statistics.median(times[(view, none)]),
                         **where_grads_live(model, storages)})
        if dist.get_rank() == 0:
            report({"grad_view": rows})
            print("\n".join(f"view={r['gradient_as_bucket_view']}, set_to_none={r['set_to_none']}: "
                            f"{r['grad_storages']} grad storages, {r['buckets']} buckets"
                            for r in rows), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
