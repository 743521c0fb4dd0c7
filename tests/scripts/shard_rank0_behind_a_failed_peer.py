"""Test script for exercise "shard": rank 1 fails at ``optimizer.state_dict()`` (it consolidated to rank 0),
while rank 0 is held back until rank 1's harness has marked its reports written (``shard_reports/1`` in
the group's store), that is until rank 1 has failed. Rank 0 then still has its save, its reports and
its replay ahead of it: they are measured only if the failed rank waits for them before it exits."""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises import shard, task

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

    optimizer.consolidate_state_dict(to=0)
    if rank == 0:  # behind, for certain: rank 1 has failed and reported before rank 0 goes on
        dist.distributed_c10d._get_default_store().wait(["shard_reports/1"], timedelta(seconds=60))
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    if rank == 0:
        torch.save(state, shard.checkpoint_path())
finally:
    dist.destroy_process_group()
