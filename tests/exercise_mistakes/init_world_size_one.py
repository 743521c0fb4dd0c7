"""Wrong answer to "init": rank and world size copied from a one-process example, the same on every rank."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo", rank=0, world_size=1)
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
print(f"rank {rank}: the sum over all ranks is {value.item():g}")
dist.destroy_process_group()
