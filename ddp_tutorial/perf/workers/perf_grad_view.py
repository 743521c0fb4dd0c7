"""Where DDP keeps the gradients: copies beside the buckets, or views into them (``gradient_as_bucket_view``).

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('perf_grad_view.py'), 2)"

DDP all-reduces flat **bucket** tensors. By default every parameter's ``.grad``
is its own tensor: backward's gradient is copied into the bucket, the bucket
is all-reduced, and the result is copied back. With
``DDP(model, gradient_as_bucket_view=True)`` each ``.grad`` becomes a view into
its bucket, so the second copy of the gradients, and the copy back, go away.

For each setting, rank 0 reports (after several steps, with ``zero_grad(set_to_none=...)``
both ways): the distinct storages behind the ``.grad`` tensors, how many of the
gradient bytes live **inside** a bucket (bucket storages are recorded by a comm
hook that all-reduces like DDP's default one), the gradient and bucket bytes,
and the median step time of the settings taking turns step by step.

Flags:
    --width W   hidden width of the 8-layer MLP (default 256: about 1.9 MB of gradients)
    --steps N   timed steps per setting (default 15)
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.runfolder import report

SETTINGS = [(False, True), (True, True), (False, False), (True, False)]  # (view, set_to_none)


def deep_model(width: int, depth: int = 8) -> nn.Module:
    layers = [nn.Linear(10, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 20))


class BucketRecorder:
    """A comm hook state: all-reduces like DDP's default hook, and remembers each bucket's storage."""

    def __init__(self):
        self.storages = {}

    @staticmethod
    def hook(state: "BucketRecorder", bucket):
        buffer = bucket.buffer()
        state.storages[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
        buffer.div_(dist.get_world_size())
        fut = dist.all_reduce(buffer, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def make(view: bool, width: int):
    torch.manual_seed(0)
    model = DDP(deep_model(width), gradient_as_bucket_view=view)
    recorder = BucketRecorder()
    model.register_comm_hook(recorder, BucketRecorder.hook)
    return model, recorder, torch.optim.SGD(model.parameters(), lr=1e-3)


def step(model, optimizer, x, y, set_to_none: bool) -> float:
    t0 = time.perf_counter()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return time.perf_counter() - t0


def where_grads_live(model, recorder) -> dict:
    grads = [p.grad for p in model.parameters()]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    inside = sum(g.numel() * g.element_size() for g in grads if g.untyped_storage().data_ptr() in recorder.storages)
    return {"grad_storages": len(storages), "buckets": len(recorder.storages),
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "bucket_bytes": sum(recorder.storages.values()), "grad_bytes_inside_buckets": inside}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        x, y = torch.randn(32, 10), torch.randn(32, 20)
        runs = [(view, none, *make(view, args.width)) for view, none in SETTINGS]
        times = {(view, none): [] for view, none in SETTINGS}
        for i in range(args.steps + 3):  # the settings take turns, so load hits them alike
            for view, none, model, recorder, optimizer in runs:
                seconds = step(model, optimizer, x, y, none)
                if i >= 3:  # the first steps build and rebuild the buckets
                    times[(view, none)].append(seconds)
        rows = []
        for view, none, model, recorder, optimizer in runs:
            recorder.storages.clear()  # only the buckets of this backward (the first one had a single bucket)
            nn.functional.mse_loss(model(x), y).backward()  # leave .grad in place to inspect it
            rows.append({"gradient_as_bucket_view": view, "set_to_none": none,
                         "step_s": statistics.median(times[(view, none)]), **where_grads_live(model, recorder)})
        if dist.get_rank() == 0:
            report({"grad_view": rows})
            for r in rows:
                print(f"gradient_as_bucket_view={r['gradient_as_bucket_view']!s:<5} "
                      f"set_to_none={r['set_to_none']!s:<5}: {r['grad_storages']} grad storages, "
                      f"{r['grad_bytes_inside_buckets'] / 1e6:.1f} of {r['grad_bytes'] / 1e6:.1f} MB inside "
                      f"{r['buckets']} buckets, step {r['step_s'] * 1e3:.1f} ms", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
