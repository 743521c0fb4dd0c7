"""Rank 1 skips one all_reduce, then waits in the next collective: the classic DDP hang."""

import datetime

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report

# A long process-group timeout: only the launcher's deadline may end this run.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
x = torch.ones(1)
report({"step": 0, "phase": "before"})
if rank != 1:
    dist.all_reduce(x)
report({"step": 1, "phase": "after skip"})
dist.all_reduce(x)
dist.barrier()
dist.destroy_process_group()
