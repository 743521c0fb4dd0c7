"""Exercise "my_ddp", wrong: one async all-reduce per gradient, each from its own hook: bucket_cap_mb is accepted
and ignored (one all-reduce per parameter at every cap). Everything else is right: the sum divided by the world
size after the wait."""

from contextlib import contextmanager

import torch
import torch.distributed as dist


class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module, self.pending, self.syncing = module, [], True
        for t in module.state_dict(keep_vars=True).values():  # parameters and buffers, tied ones once per name
            dist.broadcast(t.data, src=0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.launch)

    def launch(self, p):
        if self.syncing:
            self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        while self.pending:
            p, work = self.pending.pop(0)
            work.wait()
            p.grad /= dist.get_world_size()  # after the wait: the sum is complete

    @contextmanager
    def no_sync(self):
        self.syncing = False
        yield
        self.syncing = True
