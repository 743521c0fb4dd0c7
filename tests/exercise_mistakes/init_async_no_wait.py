"""Wrong answer to "init": all_reduce(async_op=True) and the value read without work.wait()."""

import torch
import torch.distributed as dist

# env:// (the default) reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the launcher.
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([rank + 1.0])

work = dist.all_reduce(value, async_op=True)

print(f"rank {rank}: the sum over all ranks is {value.item():g}")
dist.destroy_process_group()
