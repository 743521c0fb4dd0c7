"""Pitfall 3: saving a DDP model and loading it again.

Parts: ``wrong`` (``ddp.state_dict()`` into a plain model: the ``module.`` prefix is refused);
``rescue`` (``consume_prefix_in_state_dict_if_present``); ``right`` (rank 0 saves
``ddp.module.state_dict()``, a barrier, every rank loads with ``map_location``).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial import runfolder
from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import (
    digest, first_line, flags, regression_batch, reporter, run, shard)

report = reporter("checkpoint")

D_IN = 8


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, 1))


def save_checkpoint(ddp: DDP, path: str, rank: int) -> bool:
    """The right way: one writer, the plain model's keys, and nobody reads before it is written."""
    wrote = rank == 0
    if wrote:
        torch.save(ddp.module.state_dict(), path)  # unwrap: keys without "module."
    dist.barrier()  # the others wait here until rank 0 has finished writing
    return wrote


def load_checkpoint(path: str, device: torch.device) -> nn.Module:
    """Every rank loads onto its own device (without map_location: the device it was saved from)."""
    model = make_model().to(device)
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    return model


def saved_locations(path: str):
    """The device each tensor in ``path`` was saved from, as the file records it."""
    seen = set()

    def remember(storage, location):
        seen.add(location)
        return storage

    torch.load(path, map_location=remember, weights_only=True)
    return sorted(seen)


def parser():
    return flags(__doc__, steps=3)


def body(args, rank: int, world_size: int) -> None:
    device = torch.device("cpu")
    run_dir = runfolder.rank_run_dir(".")
    torch.manual_seed(args.seed)
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(args.steps):
        x, y = regression_batch(args.seed, step, 8 * world_size, D_IN)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()

    wrong_path = os.path.join(run_dir, "ddp_state_dict.pt")
    if rank == 0:
        torch.save(ddp.state_dict(), wrong_path)  # the DDP wrapper's state_dict
        state = torch.load(wrong_path, weights_only=True)
        plain = make_model()
        try:
            plain.load_state_dict(state)
            report({"part": "wrong", "keys": list(state), "error": None})
        except RuntimeError as err:
            result = plain.load_state_dict(state, strict=False)
            report({"part": "wrong", "keys": list(state), "error": first_line(err), "message": str(err),
                    "missing": len(result.missing_keys), "unexpected": len(result.unexpected_keys)})
        consume_prefix_in_state_dict_if_present(state, "module.")
        plain.load_state_dict(state)
        report({"part": "rescue", "keys": list(state),
                "identical": digest(plain.parameters()) == digest(ddp.module.parameters())})

    path = os.path.join(run_dir, "model_state_dict.pt")
    wrote = save_checkpoint(ddp, path, rank)
    loaded = load_checkpoint(path, device)
    report({"part": "right", "wrote": wrote, "keys": list(loaded.state_dict()),
            "identical": digest(loaded.parameters()) == digest(ddp.module.parameters()),
            "saved_from": saved_locations(path), "loaded_on": sorted({str(p.device) for p in loaded.parameters()})})


if __name__ == "__main__":
    run(body, parser())
