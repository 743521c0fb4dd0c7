"""What the lab records on a rank: each collective (notebook 10's log), the buckets torch's DDP
hands its comm hook, and when backward made each gradient."""

import contextlib
import os
import sys
import time

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.lessons.sharding.workers.sharding_common import CollectiveLog

log = CollectiveLog()


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
