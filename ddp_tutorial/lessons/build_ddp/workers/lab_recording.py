"""What the lab records on a rank: every all-reduce and broadcast (bytes, launch, completion), the buckets
torch's DDP hands its comm hook, and when backward made each gradient; and stderr silenced while a
measurement makes torch warn from C++."""

import contextlib
import os
import sys
import time

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


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


class BucketLog:
    """A comm hook's state: each bucket DDP hands to its hook, in launch order (its index, the names of its
    parameters, its bytes), then the all-reduce of ``allreduce_hook``."""

    def __init__(self, group, names):
        self.group, self.names, self.launched = group, names, []

    @staticmethod
    def hook(state, bucket):
        state.launched.append({"index": bucket.index(), "bytes": bucket.buffer().numel() * 4,
                               "params": [state.names.get(id(p), "?") for p in bucket.parameters()]})
        return default_hooks.allreduce_hook(state.group, bucket)

    def take(self):
        launched, self.launched = self.launched, []
        return launched


def ddp(model, group=None, hook=True, **kwargs):
    """torch's DDP. With ``hook`` its all-reduces go through Python, ``allreduce_hook`` (a sum of the bucket
    divided by W), so the log sees them and ``.bucket_log`` records each bucket; without, DDP's default C++
    path, which multiplies each gradient by 1/W while copying it into its bucket (reducer.cpp
    ``mark_variable_ready_dense``: ``at::mul_out(bucket_view, grad, 1/div_factor_)``, only when no comm hook
    is registered). x * (1/3) and x / 3 round differently in float32; with W = 2 or 4 both are exact."""
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped = DDP(model, process_group=group, **kwargs)
    if hook:
        wrapped.bucket_log = BucketLog(group, names)
        wrapped.register_comm_hook(wrapped.bucket_log, BucketLog.hook)
    return wrapped


def readiness(model, ready):
    """Append (perf_counter, name) to ``ready`` when backward has computed each trainable parameter's gradient.

    A tensor hook (``register_hook``) on a leaf runs before its gradient is accumulated, so before any
    post-accumulate-grad hook and before DDP's reducer hook (a post hook of the same AccumulateGrad node):
    the time does not depend on who registered first, and a launch made inside a version's hook for the
    last gradient comes after the last gradient's time, not before it."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, name=name: ready.append((time.perf_counter(), name)))


@contextlib.contextmanager
def quiet_stderr():
    """Silence this process's stderr (file descriptor 2) for a while: the reducer warns from C++, straight to it,
    that find_unused_parameters=True found no unused parameter, which is this measurement's point. An exception
    still propagates, and is printed once stderr is back."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
