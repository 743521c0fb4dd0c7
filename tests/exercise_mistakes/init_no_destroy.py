"""Wrong answer to "init": every TODO done but the last, leaving the process group."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
print(f"rank {rank}: the sum over all ranks is {value.item():g}")
