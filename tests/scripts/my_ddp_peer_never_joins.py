"""The reference MyDDP on 2 ranks; rank 1 never joins the gradient all-reduce. Rank 0's gloo all-reduce fails
at the process group's 3 s timeout, and finish_gradient_synchronization must raise it (never step on its own
gradient)."""

import datetime
import runpy
import time

import torch
import torch.distributed as dist

from ddp_tutorial.exercises import EXERCISES

MyDDP = runpy.run_path(str(EXERCISES["my_ddp"].solution))["MyDDP"]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
model = MyDDP(torch.nn.Linear(4, 2))
if dist.get_rank() == 0:
    model(torch.randn(8, 4)).sum().backward()
    model.finish_gradient_synchronization()
    print("rank 0 returned from finish_gradient_synchronization", flush=True)
else:
    time.sleep(60)  # the peer that never comes: the launcher stops it once rank 0 fails
