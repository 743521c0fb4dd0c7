"""The smallest DDP job: init, one all_reduce, a barrier, tear down. Run it as torchrun would:
``torchrun --standalone --nproc-per-node 4 ddp_tutorial/maintainer/workers/hello.py``."""

import time

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import rank_run_dir, report

t0 = time.perf_counter()
dist.init_process_group("gloo")
init_s = time.perf_counter() - t0
rank, world_size = dist.get_rank(), dist.get_world_size()
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)  # default op: SUM over ranks
dist.barrier()
print(f"rank {rank}/{world_size}: all_reduce(rank + 1) = {x.item():g}, init took {init_s * 1e3:.0f} ms",
      flush=True)
if rank_run_dir():
    report({"world_size": world_size, "all_reduce_sum": x.item(), "init_s": init_s})
dist.destroy_process_group()
