"""Exercise "my_ddp": write DistributedDataParallel yourself.

MyDDP(module, bucket_cap_mb=25.0) wraps a module so that, used like this on every rank,

    model = MyDDP(module, bucket_cap_mb=...)
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()

every rank takes the step torch's DistributedDataParallel would:

1. at construction, every rank gets rank 0's parameters and buffers;
2. the gradients are averaged over the ranks (all-reduced, divided by the world size);
3. the all-reduces start during backward, from hooks (p.register_post_accumulate_grad_hook), with
   async_op=True, one per bucket; finish_gradient_synchronization() waits for them. Buckets take the
   trainable parameters in one fixed order, the same on every rank; a new bucket starts when the
   next gradient would pass bucket_cap_mb (DDP's rule, closing a bucket once it reaches the cap,
   passes too);
4. inside `with model.no_sync():` nothing is all-reduced: gradients accumulate locally.

Tied weights, frozen parameters and buffers must work. A trainable parameter no forward uses gets
no gradient: finish_gradient_synchronization() must then raise (as torch's DDP does; averaging the
rest as DDP(find_unused_parameters=True) does passes too), never leave gradients un-averaged.
Then, in the notebook: exercises.check("my_ddp")
"""

import contextlib

import torch
import torch.distributed as dist  # noqa: F401 (you will need it)


class MyDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        # TODO: broadcast rank 0's parameters and buffers to every rank.
        # TODO: group the trainable parameters into buckets; register a hook on each.

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass  # TODO: wait for every all-reduce launched during backward, then leave the averages in p.grad

    @contextlib.contextmanager
    def no_sync(self):
        yield  # TODO: no all-reduce for the backward inside
