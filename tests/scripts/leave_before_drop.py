"""Leaves the process group while its DDP model still holds it; the model goes when train() returns.

The order the kit teaches against (notebook 05): torch decides what happens, under launch as under torchrun.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train():
    dist.init_process_group("gloo")
    model = DDP(torch.nn.Linear(8, 8))
    model(torch.randn(4, 8)).sum().backward()
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank())
    dist.destroy_process_group()  # the model still holds the group


train()  # returning drops the model, the group's last reference
print("train() returned", flush=True)
