"""What the lab records on a rank: each all-reduce and broadcast, the buckets torch's DDP hands its
comm hook, and when backward made each gradient."""

import contextlib
import os
import sys
import time

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


class Collectives:
    """Every dist.all_reduce and dist.broadcast made while recording: bytes, launch and completion
    (perf_counter; an async one completes when its future does, seen from gloo's thread)."""

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
    """A comm hook's state: each bucket DDP hands its hook (index, parameter names, bytes), then
    ``allreduce_hook``'s all-reduce."""

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
    """torch's DDP. With ``hook``, ``allreduce_hook`` (sum, then / W) in Python: the log sees it and
    ``.bucket_log`` each bucket. Without, the C++ path multiplies by 1/W into the bucket (reducer.cpp
    ``mark_variable_ready_dense``: ``at::mul_out(bucket_view, grad, 1/div_factor_)``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped = DDP(model, process_group=group, **kwargs)
    if hook:
        wrapped.bucket_log = BucketLog(group, names)
        wrapped.register_comm_hook(wrapped.bucket_log, BucketLog.hook)
    return wrapped


def readiness(model, ready):
    """Append (perf_counter, name) to ``ready`` when backward has computed each trainable gradient:
    a leaf's tensor hook runs before its gradient is accumulated, so before any post-accumulate-grad
    hook and DDP's reducer hook (a post hook of the same AccumulateGrad node)."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad, name=name: ready.append((time.perf_counter(), name)))


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2: the reducer warns from C++ that find_unused_parameters=True found
    no unused parameter, which is this measurement's point."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
