"""Exercise "my_ddp", wrong: the gradients are summed, never divided by the world size."""

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
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived, self.launched = [0] * len(self.buckets), []
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._arrive)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _arrive(self, p):
        if not self.sync:
            return
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] == len(self.buckets[i]):  # the bucket's last gradient: launch it now
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self.launched.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        for i, flat, handle in self.launched:
            handle.wait()  # before the optimizer reads the gradients
            for p, part in zip(self.buckets[i], flat.split([q.numel() for q in self.buckets[i]])):
                p.grad.copy_(part.view_as(p.grad))
        unfinished = sum(a < len(b) for a, b in zip(self.arrived, self.buckets))
        self.launched, self.arrived = [], [0] * len(self.buckets)
        if unfinished:  # a parameter no forward used: its bucket never launched
            raise RuntimeError(f"{unfinished} bucket(s) never got all their gradients")

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
