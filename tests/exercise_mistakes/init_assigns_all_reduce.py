"""Wrong answer to "init": all_reduce's return value used as if it were the sum (it works in place)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
total = dist.all_reduce(value)  # None: the sum is in `value`
print(f"rank {rank}: the sum over all ranks is {total.item():g}")
dist.destroy_process_group()
