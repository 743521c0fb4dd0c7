"""Wrong answer to "init": a hard-coded rendezvous port instead of the launcher's MASTER_PORT."""

import os

import torch
import torch.distributed as dist

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=rank, world_size=world_size)
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
dist.destroy_process_group()
