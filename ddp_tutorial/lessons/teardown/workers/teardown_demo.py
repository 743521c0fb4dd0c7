"""Why ``destroy_process_group`` matters: a process can join a new group only after it.

    torchrun --standalone --nproc-per-node 2 ddp_tutorial/lessons/teardown/workers/teardown_demo.py

Each rank joins, calls ``init_process_group`` again without leaving (it fails), then leaves with
``destroy_process_group``, joins again and all-reduces. Reported: ``second_init_error``,
``initialized_after_reinit``, ``reinit_all_reduce``.
"""

import os

import torch
import torch.distributed as dist

from ddp_tutorial.runfolder import report


def all_reduce_ranks() -> float:
    """Sum of (rank + 1) over the group: proves the group works."""
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return x.item()


def rejoin(rank: int) -> None:
    """Join a new group after ``destroy_process_group``. An agent's store (torchrun, ``launch``)
    outlives the group with its addresses: a fresh key prefix gives the new group a clean slate.
    A store that rank 0 hosted (plain env://) died with the group, and env:// starts a new one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("rejoin", store),
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        first_sum = all_reduce_ranks()
        try:
            dist.init_process_group("gloo")  # the group of this process still exists
            error = None
        except Exception as exc:  # what a second init without teardown raises
            error = {"type": type(exc).__name__, "message": str(exc)}
        # Every rank leaves the old group before any joins the new one, so a fast
        # rank cannot meet the old rendezvous store of a slow one.
        dist.barrier()
        dist.destroy_process_group()
        rejoin(rank)
        report({"first_all_reduce": first_sum, "second_init_error": error,
                "initialized_after_reinit": dist.is_initialized(),
                "reinit_all_reduce": all_reduce_ranks()})
        print(f"rank {rank}: second init without teardown -> "
              f"{error['type'] if error else 'no error'}; after destroy_process_group it joined "
              "again", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
