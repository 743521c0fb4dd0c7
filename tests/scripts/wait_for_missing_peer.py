"""Rank 1 waits in an all_reduce that rank 0 never calls; rank 0 stays in its own code."""

import datetime
import time

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report


def rank0_keeps_computing() -> None:
    while True:
        time.sleep(3600)  # the hang itself: only the launch deadline ends it


# A long process-group timeout: only the launcher's deadline may end this run.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
report({"phase": "joined"})
if dist.get_rank() == 0:
    rank0_keeps_computing()
dist.all_reduce(torch.ones(1))
