"""Exercise "init": join the process group, then add up one number from every rank.

Each rank holds rank + 1; after an all-reduce (sum) every rank should hold
1 + 2 + ... + world_size. Fill in the TODOs, then, in the notebook:

    exercises.check("init")
"""

import os

import torch
import torch.distributed as dist  # noqa: F401 (you will need it)

# TODO 1: join the process group with the "gloo" backend (CPU). The launcher (launch or
#         torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for this process.

rank = int(os.environ.get("RANK", 0))  # TODO 2: once you have joined, ask the group for your rank
value = torch.tensor([rank + 1.0])

# TODO 3: sum `value` over all ranks, in place.

print(f"rank {rank}: the sum over all ranks is {value.item():g}")

# TODO 4: leave the process group.
