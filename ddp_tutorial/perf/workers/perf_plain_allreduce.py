"""The cross-check: a bare ``dist.all_reduce`` loop on one 16 MB tensor, with nothing of the kit in it.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/perf/workers/perf_plain_allreduce.py
    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('perf_plain_allreduce.py'), 2)"

Prints (and, under ``launch``, reports as ``seconds``) the time of one all-reduce: the mean
over a loop of calls, from the fastest of 5 loops.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from ddp_tutorial.backend import backend_for_this_node

nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16 * 1024 ** 2
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_num_threads(1)
backend, _ = backend_for_this_node()  # nccl only with one GPU per rank, as train.py decides
dist.init_process_group(backend)
try:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else "cpu"
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up
    loops = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if backend == "nccl":
            torch.cuda.synchronize()
        loops.append((time.perf_counter() - t0) / iters)
    seconds = min(loops)
    if dist.get_rank() == 0:
        print(f"plain all_reduce of {nbytes} B on {dist.get_world_size()} ranks: {seconds * 1e3:.2f} ms",
              flush=True)
        from ddp_tutorial.runfolder import rank_run_dir, report

        if rank_run_dir():
            report({"bytes": nbytes, "seconds": seconds, "world_size": dist.get_world_size()})
finally:
    dist.destroy_process_group()
