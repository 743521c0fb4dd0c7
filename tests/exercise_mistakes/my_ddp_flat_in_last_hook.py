"""Exercise "my_ddp", wrong: one flat all-reduce of every gradient, launched from the hook of the gradient that
backward produces last (the first layer's weight): the cap is ignored, and nothing is left to overlap."""

import contextlib

import torch
import torch.distributed as dist


class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module, self.sync, self.pending = module, True, None
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.params[0].register_post_accumulate_grad_hook(self._last)  # backward reaches the first layer last

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _last(self, _):
        if self.sync:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])
            self.pending = (flat.div_(dist.get_world_size()), dist.all_reduce(flat, async_op=True))

    def finish_gradient_synchronization(self):
        flat, handle = self.pending
        handle.wait()
        with_grad = [p for p in self.params if p.grad is not None]
        for p, part in zip(with_grad, flat.split([p.numel() for p in with_grad])):
            p.grad.copy_(part.view_as(p.grad))
        self.pending = None

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
