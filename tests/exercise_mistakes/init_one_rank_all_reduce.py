"""Wrong answer to "init": only rank 0 calls all_reduce (as if the sum were rank 0's job)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
if rank == 0:
    dist.all_reduce(value)  # rank 1 never joins it
print(f"rank {rank}: the sum over all ranks is {value.item():g}")
dist.destroy_process_group()
