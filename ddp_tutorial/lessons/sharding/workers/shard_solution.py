"""Exercise "shard", solved: ZeroRedundancyOptimizer keeps each rank's share of Adam's state only."""

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises import shard
from ddp_tutorial.exercises.workers import task

dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    model = DDP(task.make_model())
    dataset = task.make_dataset()
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=task.BATCH_SIZE, sampler=sampler)

    # Each rank builds an Adam for its share of the parameters; lr= is passed on to it.
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=shard.LR)

    for epoch in range(task.EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            task.loss_fn(model(x), y).backward()
            optimizer.step()  # steps this rank's share, then broadcasts the updated parameters

    optimizer.consolidate_state_dict(to=0)  # a collective: one broadcast per other rank's shard, all ranks take part
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                   shard.checkpoint_path())
finally:
    dist.destroy_process_group()
