"""The cross-check: a bare ``dist.all_reduce`` loop on one 16 MB tensor, nothing of the kit in it.

    torchrun --standalone --nproc-per-node 2 perf_plain_allreduce.py

Prints (under ``launch`` also reports) the mean time of one call, from the fastest of 5 loops.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from ddp_tutorial.backend import backend_for_this_node

nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16 * 1024 ** 2
torch.set_num_threads(1)
backend, _ = backend_for_this_node()  # nccl only with one GPU per rank, as train.py decides
dist.init_process_group(backend)
try:
    nccl = backend == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if nccl else "cpu"
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up
    loops = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(4):
            dist.all_reduce(x)
        if nccl:
            torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / 4)
    seconds = min(loops)
    if dist.get_rank() == 0:
        print(f"plain all_reduce of {nbytes} B on {dist.get_world_size()} ranks: "
              f"{seconds * 1e3:.2f} ms", flush=True)
        from ddp_tutorial.runfolder import rank_run_dir, report

        if rank_run_dir():
            report({"seconds": seconds})
finally:
    dist.destroy_process_group()
