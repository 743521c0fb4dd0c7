"""The smallest DDP job: init the process group, one all_reduce, a barrier, tear down.

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/maintainer/workers/hello.py
    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('hello.py'), 4)"

``--wait-for-store`` (a variant the bench times): ranks other than 0 wait until rank 0's store
listens before init, as a store client refused a connection backs off before it tries again.
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import rank_run_dir, report

if "--wait-for-store" in sys.argv and int(os.environ["RANK"]) != 0:
    store, deadline = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), time.monotonic() + 60
    while True:  # polling: nothing says when rank 0's store listens
        try:
            socket.create_connection(store, timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
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
