"""DistributedDataParallel built by hand, one idea at a time (rank code; notebook 11 shows each
class). Each starts every rank from rank 0's weights and needs ``finish_gradient_synchronization()``
between backward and the step. ``SimulatedGpuKernel``'s backward waits without using the CPU, as a
CPU thread waits for a GPU kernel: it makes overlap visible on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist


def broadcast_from_rank0(module, group=None):
    """Every rank starts from rank 0's parameters and buffers (in place, one broadcast per tensor)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0, group=group)  # src is a global rank: 0 is in every group here


class NaiveDDP(torch.nn.Module):
    """After backward: one blocking all_reduce per gradient, then divide by W."""

    def __init__(self, module, group=None):
        super().__init__()
        self.module, self.group = module, group
        broadcast_from_rank0(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size(self.group)
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)  # SUM over the ranks, in place
                p.grad.div_(world_size)


class FlatDDP(NaiveDDP):
    """After backward: every gradient copied into one flat tensor (in reverse registration order, the
    order backward usually produces them), one all_reduce, then divide by W and copy back."""

    def finish_gradient_synchronization(self):
        grads = [p.grad for p in reversed(list(self.module.parameters())) if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(dist.get_world_size(self.group))
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))


class OverlapDDP(NaiveDDP):
    """A hook per parameter launches an async all_reduce the moment its gradient is accumulated."""

    def __init__(self, module, group=None):
        super().__init__(module, group)
        self.handles, self.sync = [], True
        for p in module.parameters():  # a tied parameter is listed once: one hook, one gradient
            if p.requires_grad:  # a frozen parameter gets no gradient, so no hook
                p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p):
        # Decided in backward; torch's DDP decides in forward (distributed.py _pre_forward and
        # _post_forward read require_backward_grad_sync).
        if self.sync:
            p.grad.div_(dist.get_world_size(self.group))  # before the launch: never touch it after
            self.handles.append(dist.all_reduce(p.grad, group=self.group, async_op=True))

    def finish_gradient_synchronization(self):
        for handle in self.handles:
            handle.wait()  # the optimizer must not read a gradient still being reduced
        self.handles.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally; the next backward outside it all-reduces their sum once."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class BucketDDP(OverlapDDP):
    """Gradients in buckets in reverse registration order (the order backward usually produces them),
    a new bucket started when the next gradient would pass ``bucket_cap_mb`` (so a bucket holds at
    most the cap, unless one gradient alone is bigger); a bucket is all-reduced, flat, once its last
    gradient is in, as soon as it is ready (torch's DDP waits for every earlier bucket first)."""

    def __init__(self, module, bucket_cap_mb=25.0, group=None):
        NaiveDDP.__init__(self, module, group)
        self.sync = True
        cap = bucket_cap_mb * 2**20
        self.buckets, size = [[]], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if self.buckets[-1] and size + nbytes > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._new_step()
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._arrive)

    def _new_step(self):
        self.arrived = [0] * len(self.buckets)
        # One future per bucket, completed with its reduced flat tensor once its all-reduce is done.
        self.reduced = [torch.futures.Future() for _ in self.buckets]

    def _arrive(self, p):
        if not self.sync:
            return
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] == len(self.buckets[i]):  # the bucket's last gradient: launch it
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            flat.div_(dist.get_world_size(self.group))
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            work.get_future().add_done_callback(functools.partial(_pass_on, flat=flat, to=self.reduced[i]))

    def finish_gradient_synchronization(self):
        # A failed all-reduce raises here (_pass_on). A bucket whose gradient never came was never
        # launched: waiting for its Future waits for ever (find_unused_parameters=True marks such
        # parameters ready instead).
        for bucket, reduced in zip(self.buckets, self.reduced):
            flat = reduced.wait()
            for p, part in zip(bucket, flat.split([q.numel() for q in bucket])):
                p.grad.copy_(part.view_as(p.grad))
        self._new_step()


def _pass_on(fut, flat, to):
    """Complete ``to`` with the reduced ``flat``, or with the all-reduce's error (gloo's timeout):
    finish_gradient_synchronization then raises, never steps on this rank's own gradient."""
    try:
        fut.wait()  # re-raises the collective's error
    except Exception as exc:  # noqa: BLE001  handed on whole, to be raised where the step waits
        to.set_exception(exc)
    else:
        to.set_result(flat)


class _WaitLikeAGpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)  # the simulated GPU kernel: time passes, no CPU is used
        return grad, None


class SimulatedGpuKernel(torch.nn.Module):
    """Identity forward; its backward takes ``ms`` without using the CPU, like a CPU waiting for a
    GPU kernel. The only sleep in the lab, and it is the simulated kernel, not synchronisation."""

    def __init__(self, ms):
        super().__init__()
        self.seconds = ms / 1000

    def forward(self, x):
        return _WaitLikeAGpu.apply(x, self.seconds)
