"""Restarts and faults: a rendezvous store a restarted group can use, the attempt all ranks agree
on, and the fault ``--fail-at-step`` injects on the first attempt only (``Instrument`` calls them).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ddp_tutorial import envvars


def restart_safe_store(timeout_s: float) -> Optional[dist.Store]:
    """A key space of its own for a restarted attempt; None (the usual env://) where none is needed.
    torchrun's agent keeps one store for the job and env:// adds no per-attempt prefix, so a
    restarted group would read the dead group's addresses. Agents count restarts differently: a
    multi-node job that may restart needs ``FRESH_RDZV_STORE`` (docs/clusters.md), else an error.
    """
    if os.environ.get(envvars.USE_AGENT_STORE) != "True":
        return None  # no shared store (one process, or torchrun with a fresh store per round)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if nodes > 1 and int(os.environ.get(envvars.MAX_RESTARTS, 0)) > 0:
        raise RuntimeError(
            f"{nodes} torchrun agents with --max-restarts share one rendezvous store, and a "
            "restart could read the dead group's addresses from it (its agents count restarts "
            f"differently): export {envvars.FRESH_RDZV_STORE}=1 before torchrun on every node "
            "(docs/clusters.md)")
    attempt = envvars.restart_attempt()
    if attempt == 0:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"ddp_tutorial/attempt{attempt}", store)


def group_attempt(env) -> int:
    """The restart attempt every rank agrees on (``env``: step 1's ``DistEnv``): the largest of
    their agents' counts, since only an agent whose own workers failed counts a restart."""
    attempt = envvars.restart_attempt()
    if not env.distributed or int(os.environ.get(envvars.MAX_RESTARTS, 0)) == 0:
        return attempt  # no restart can have happened, or only this process counts
    count = torch.tensor([attempt], device=env.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@dataclass
class Fault:
    """``rank`` fails at micro-step ``step`` (counted over the run), on the first attempt only, by
    ``mode``: "raise" an exception, "exit" with code 3, or "hang"."""

    step: int
    rank: int = 0
    mode: str = "raise"

    def fire_if_due(self, rank: int, step: int, attempt: int) -> None:
        """Fail if this is the step and rank, on the group's first ``attempt``."""
        if step != self.step or rank != self.rank or attempt > 0:
            return
        print(f"injected failure ({self.mode}) at step {step}", flush=True)
        if self.mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if self.mode == "exit":
            sys.exit(3)
        while True:  # "hang": the other ranks wait for this one in their next all-reduce
            time.sleep(3600)
