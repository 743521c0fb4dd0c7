"""Step 1 up close: time init_process_group, do one all_reduce of rank + 1, report both.

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/lessons/init_wrap/workers/init_demo.py

Each rank prints one line and, under ``launch``, reports (``run.result(rank, key)``):
``arrive_time`` and ``done_time`` (wall clock before and after init), ``init_s``,
``all_reduce_sum`` (expected: 1 + 2 + ... + world_size), ``backend``, ``master_port``,
``torch_threads`` (threads this rank runs), ``cpu_count``, ``default_threads`` (with
``--probe-default-threads``, rank 0 only: torch's own choice in a fresh process
without OMP_NUM_THREADS; else None), and the process-group timeouts
torch uses when ``init_process_group`` gets no ``timeout``: ``default_pg_timeout_s``
(gloo and the others) and ``default_pg_nccl_timeout_s`` (None in a build without nccl).

Flags:
    --threads N    torch threads per rank (default 1); 0 keeps what the process started with
                   (OMP_NUM_THREADS, which launch and torchrun both set to 1).
    --probe-default-threads  rank 0 asks a fresh Python how many threads torch picks by itself.
    --backend B    auto (nccl when every rank has a GPU of its own, else gloo), gloo or nccl.
    --pg-timeout S init_process_group's timeout in seconds (default: torch's own, 30 min for
                   gloo): how long the rendezvous, and every later collective, may wait.
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
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank; 0 = as the process started (OMP_NUM_THREADS)")
    p.add_argument("--probe-default-threads", action="store_true",
                   help="rank 0 reports how many threads torch picks in a fresh process")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="init_process_group's timeout in seconds (default: torch's)")
    return p.parse_args()


def torch_default_threads() -> int:
    """Threads torch picks by itself: asked of a fresh Python without OMP_NUM_THREADS or MKL_NUM_THREADS.

    torch sizes its thread pool once, when it is imported, from those variables or else
    from the machine's cores. This process cannot show it: it started with
    OMP_NUM_THREADS=1 (launch and torchrun both set it), and a rank forked warm had
    torch imported before this script ran.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           env=env, capture_output=True, text=True, check=True, timeout=300)
    return int(probe.stdout.split()[-1])


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend, _ = backend_for_this_node(args.backend)  # auto: nccl only with one GPU per rank
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    rank_env = os.environ.get("RANK", "0")
    print(f"rank {rank_env}: calling init_process_group (WORLD_SIZE={os.environ.get('WORLD_SIZE')}, "
          f"store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')})", flush=True)
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
        default_threads = torch_default_threads() if args.probe_default_threads and rank == 0 else None
        report({"world_size": world_size, "backend": backend, "master_port": os.environ.get("MASTER_PORT"),
                "arrive_time": arrive_time, "done_time": done_time, "init_s": init_s,
                "all_reduce_sum": x.item(), "torch_threads": torch.get_num_threads(),
                "default_threads": default_threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "cpu_count": os.cpu_count(),
                "default_pg_timeout_s": constants.default_pg_timeout.total_seconds(),
                "default_pg_nccl_timeout_s": (constants.default_pg_nccl_timeout.total_seconds()
                                              if constants.default_pg_nccl_timeout else None)})
        dist.barrier()  # nobody tears down while a peer still needs the store
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
