"""Exercise "my_ddp", solved: broadcast at construction, gradients in buckets all-reduced from hooks.

Buckets: reverse registration order, a new one when the next gradient would pass the cap. A
parameter that got no gradient leaves its bucket unlaunched: finish_gradient_synchronization()
raises, as torch's DDP raises at the next forward (``Reducer::ensure_prior_reduction_finished``).
"""

import contextlib

import torch
import torch.distributed as dist


class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module, self.sync = module, True
        self.world_size = dist.get_world_size()
        with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        # Buckets in reverse registration order, the same on every rank; frozen parameters left out.
        cap, self.buckets, size = bucket_cap_mb * 2**20, [[]], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            if self.buckets[-1] and size + p.numel() * p.element_size() > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived, self.launched = [set() for _ in self.buckets], []
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._arrive)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _arrive(self, p):
        if not self.sync:
            return
        i = self.bucket_of[id(p)]
        self.arrived[i].add(id(p))
        if len(self.arrived[i]) == len(self.buckets[i]):  # the bucket's last gradient: launch it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]).div_(self.world_size)
            self.launched.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        launched, arrived = self.launched, self.arrived
        self.launched, self.arrived = [], [set() for _ in self.buckets]  # the next step starts afresh
        for i, flat, handle in launched:
            handle.wait()  # before the optimizer reads the gradients; raises if the all-reduce failed
            for p, part in zip(self.buckets[i], flat.split([q.numel() for q in self.buckets[i]])):
                p.grad.copy_(part.view_as(p.grad))
        missing = [self.names[id(p)] for i, bucket in enumerate(self.buckets) for p in bucket
                   if id(p) not in arrived[i]]
        if missing:
            raise RuntimeError(f"MyDDP: no gradient for {', '.join(missing)} in this backward, so "
                               f"{len(self.buckets) - len(launched)} bucket(s) were never all-reduced. Every "
                               "trainable parameter must take part in the loss (torch's DDP raises too, unless "
                               "find_unused_parameters=True)")

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
