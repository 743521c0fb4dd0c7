"""train.main with the kit's hooks; at destroy_process_group, count the DDP models still alive.

The count must be 0: a DDP model that outlives destroy_process_group keeps its gloo group,
and dropping it later (with the GIL held) can deadlock in torch 2.13.
"""

import gc
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import train
from ddp_tutorial.runfolder import report

leave = dist.destroy_process_group


def destroy_process_group(*args, **kwargs):
    gc.collect()
    report({"ddp_models_alive": sum(issubclass(type(o), DDP) for o in gc.get_objects())})
    return leave(*args, **kwargs)


dist.destroy_process_group = destroy_process_group
sys.exit(train.main(sys.argv[1:]))
