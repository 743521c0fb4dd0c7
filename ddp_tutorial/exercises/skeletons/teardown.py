"""Exercise "teardown": leave the process group, also when training raises.

The check runs this twice: once as it is, and once with one rank made to raise
in the middle of training (task.loss_fn raises there). Both times every rank
should leave the process group before it exits. Then:

    exercises.check("teardown")
"""

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")

# TODO: whatever happens in the training below, leave the process group before
#       this process exits: dist.destroy_process_group(). Drop the DDP model first
#       (model = None): it holds the group.
model = DDP(task.make_model())
optimizer = task.make_optimizer(model.parameters())
dataset = task.make_dataset()
sampler = DistributedSampler(dataset, shuffle=True, seed=task.SEED)
loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)
for epoch in range(task.EPOCHS):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        task.loss_fn(model(x), y).backward()
        optimizer.step()
