"""Step 1 up close: time init_process_group, do one all_reduce of rank + 1, report both, with the
rank's threads and torch's default process-group timeouts (``torch.distributed.constants``).

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/lessons/init_wrap/workers/init_demo.py
"""

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import constants

from ddp_tutorial.backend import backend_for_this_node
from ddp_tutorial.runfolder import report


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe-default-threads", action="store_true",
                   help="rank 0 reports how many threads torch picks in a fresh process")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="init_process_group's timeout in seconds (default: torch's)")
    return p.parse_args()


def torch_default_threads() -> int:
    """Threads torch picks in a fresh Python without OMP_NUM_THREADS or MKL_NUM_THREADS: it sizes
    its pool at import, and this rank started with OMP_NUM_THREADS=1 (as torchrun sets it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           env=env, capture_output=True, text=True, check=True, timeout=300)
    return int(probe.stdout.split()[-1])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank: ranks share a small machine's cores
    backend, _ = backend_for_this_node(args.backend)  # auto: nccl only with one GPU per rank
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    env = os.environ
    print(f"rank {env.get('RANK', '0')}: calling init_process_group (WORLD_SIZE="
          f"{env.get('WORLD_SIZE')}, store at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')})",
          flush=True)
    arrive_time = time.time()
    t0 = time.perf_counter()
    # Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment; rank 0
    # hosts the TCP store there. With gloo the call returns once every rank has
    # connected to every other; nccl connects lazily, at the first collective.
    # timeout=None means torch's default (30 min for gloo, 10 for nccl).
    timeout = None if args.pg_timeout is None else datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group(backend, timeout=timeout)
    init_s = time.perf_counter() - t0
    done_time = time.time()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        print(f"rank {rank}: init_process_group returned after {init_s * 1e3:.0f} ms", flush=True)
        x = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(x)  # default op: SUM, and every rank receives the result
        print(f"rank {rank}/{world_size}: all_reduce(rank + 1) = {x.item():g} "
              f"(expected {world_size * (world_size + 1) // 2})", flush=True)
        probe = args.probe_default_threads and rank == 0
        default_threads = torch_default_threads() if probe else None
        report({"world_size": world_size, "arrive_time": arrive_time, "done_time": done_time,
                "init_s": init_s, "all_reduce_sum": x.item(), "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(), "default_threads": default_threads,
                "default_pg_timeout_s": constants.default_pg_timeout.total_seconds(),
                "default_pg_nccl_timeout_s": (constants.default_pg_nccl_timeout.total_seconds()
                                              if constants.default_pg_nccl_timeout else None)})
        dist.barrier()  # nobody tears down while a peer still needs the store
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
