"""Step 1 up close: time init_process_group, do one all_reduce of rank + 1, report both.

    torchrun --standalone --nproc-per-node 4 ddp_tutorial/lessons/init_wrap/workers/init_demo.py
    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('init_demo.py'), 4)"

Each rank prints one line and, under ``launch``, reports (``run.result(rank, key)``):
``arrive_time`` and ``done_time`` (wall clock before and after init), ``init_s``,
``all_reduce_sum`` (expected: 1 + 2 + ... + world_size), ``backend``, ``master_port``,
``torch_threads`` (threads this rank runs) and ``default_threads`` (torch's own
choice without OMP_NUM_THREADS), ``cpu_count``, and the process-group timeouts
torch uses when ``init_process_group`` gets no ``timeout``: ``default_pg_timeout_s``
(gloo and the others) and ``default_pg_nccl_timeout_s`` (None in a build without nccl).

Flags:
    --threads N    torch threads per rank (default 1); 0 keeps torch's default.
    --backend B    auto (nccl when every rank has a GPU of its own, else gloo), gloo or nccl.
    --pg-timeout S init_process_group's timeout in seconds (default: torch's own, 30 min for
                   gloo): how long the rendezvous, and every later collective, may wait.
"""

import argparse
import datetime
import os
import time

# The launcher sets OMP_NUM_THREADS=1 for every rank. Drop it before torch loads,
# so torch.get_num_threads() shows torch's own default, then set the count explicitly.
_LAUNCHER_OMP = os.environ.pop("OMP_NUM_THREADS", None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import constants  # noqa: E402

from ddp_tutorial.backend import backend_for_this_node  # noqa: E402
from ddp_tutorial.runfolder import report  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank; 0 = torch's default")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="init_process_group's timeout in seconds (default: torch's)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or default_threads)
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
        report({"world_size": world_size, "backend": backend, "master_port": os.environ.get("MASTER_PORT"),
                "arrive_time": arrive_time, "done_time": done_time, "init_s": init_s,
                "all_reduce_sum": x.item(), "torch_threads": torch.get_num_threads(),
                "default_threads": default_threads, "launcher_omp_num_threads": _LAUNCHER_OMP,
                "cpu_count": os.cpu_count(),
                "default_pg_timeout_s": constants.default_pg_timeout.total_seconds(),
                "default_pg_nccl_timeout_s": (constants.default_pg_nccl_timeout.total_seconds()
                                              if constants.default_pg_nccl_timeout else None)})
        dist.barrier()  # nobody tears down while a peer still needs the store
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
