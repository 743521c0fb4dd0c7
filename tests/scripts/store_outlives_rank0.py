"""Rank 0's script ends first; rank 1 then goes on using the rendezvous store for a second.

torchrun's agent hosts the store for the whole run. Under ``launch`` rank 0 hosts it, and
must keep it until rank 1 has exited. ``--then-fail``: rank 1 fails afterwards, and rank 0,
whose script succeeded, must still exit 0.
"""

import os
import pathlib
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()  # both have joined: neither leaves while the other is still connecting
rank0_done = pathlib.Path(os.environ["DDP_TUTORIAL_RUN_DIR"]) / "rank0-done"
if dist.get_rank() == 0:
    dist.destroy_process_group()
    rank0_done.touch()  # rank 0's script ends here
else:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    while not rank0_done.exists():  # waits for an event (the file), not for a time
        time.sleep(0.01)
    end, sets = time.monotonic() + 1.0, 0
    while time.monotonic() < end:
        store.set(f"after-rank-0/{sets}", "x")
        sets += 1
    print(f"the store answered {sets} sets after rank 0's script ended", flush=True)
    dist.destroy_process_group()
    if "--then-fail" in sys.argv:
        raise SystemExit(3)
