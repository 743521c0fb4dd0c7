"""Wrong answer to "init" that hangs: only rank 0 calls all_reduce; rank 1 waits at a barrier."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])
if rank == 0:
    dist.all_reduce(value)  # rank 1 never joins it
dist.barrier()
dist.destroy_process_group()
