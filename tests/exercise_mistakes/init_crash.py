"""Wrong answer to "init" that crashes on rank 1 (a division by rank - 1)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
share = value.item() / (rank - 1)  # ZeroDivisionError on rank 1
dist.destroy_process_group()
