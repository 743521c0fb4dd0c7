"""When a peer is gone: how long a surviving gloo rank takes to notice; exit without teardown.

    python -c "import ddp_tutorial as d; d.launch(d.scripts_path('peer_exit_demo.py'), 2)"

Default: after one all-reduce the last rank vanishes (``os._exit(0)``, an exit code the launcher
does not treat as a failure); every other rank all-reduces again and reports ``seconds_to_error``,
``error_type``, ``error`` and ``pg_timeout_s``. ``--no-teardown``: every rank all-reduces, meets
at a barrier and returns without ``destroy_process_group``.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--no-teardown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1)
    dist.all_reduce(x)
    if args.no_teardown:
        dist.barrier()
        report({"all_reduce": x.item()})
        print(f"rank {rank}: leaving without destroy_process_group", flush=True)
        return
    if rank == world_size - 1:
        os._exit(0)  # gone, with no teardown and no error message
    t0 = time.perf_counter()
    try:
        dist.all_reduce(x)
        outcome = {"error_type": None, "error": None}
    except Exception as exc:  # what a survivor sees
        outcome = {"error_type": type(exc).__name__, "error": str(exc).splitlines()[0][:300]}
    seconds = time.perf_counter() - t0
    report({"seconds_to_error": seconds, "pg_timeout_s": args.pg_timeout, **outcome})
    print(f"rank {rank}: all_reduce without its peer failed after {seconds:.3f} s: "
          f"{outcome['error_type']}: {outcome['error']}", flush=True)
    os._exit(0)  # the group is broken: there is nothing left to tear down cleanly


if __name__ == "__main__":
    main()
