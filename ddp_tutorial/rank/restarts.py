"""Restarts and faults: a rendezvous store a restarted group can use, the attempt all ranks
agree on, and the transient fault ``--fail-at-step`` injects on the first attempt only.

``torchrun --max-restarts`` (or ``launch(max_restarts=...)``) starts the whole group
again with ``TORCHELASTIC_RESTART_COUNT`` raised; train.py then resumes from its
checkpoint (``ddp_tutorial.checkpoint``). ``Instrument`` (``rank/instrument.py``) calls these.
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
    """A key space of its own for a restarted attempt (its operations wait ``timeout_s``); None
    (the usual env://) where none is needed.

    torchrun's agent keeps one store for the whole job, and env:// adds no per-attempt prefix, so a
    restarted gloo group would read the dead group's addresses. With one agent every rank has the
    same ``TORCHELASTIC_RESTART_COUNT``, and a prefix per attempt hides the old keys; several agents
    count restarts differently, so a multi-node job that may restart must have each round make a
    fresh store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and is refused (RuntimeError) without.
    Why, in torch's source: docs/clusters.md, "Restarts across nodes: what the kit relies on".
    """
    if os.environ.get(envvars.USE_AGENT_STORE) != "True":
        return None  # no shared store (one process, or torchrun with a fresh store per round)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    if nodes > 1 and int(os.environ.get(envvars.MAX_RESTARTS, 0)) > 0:
        raise RuntimeError(
            f"{nodes} torchrun agents with --max-restarts share one rendezvous store, and a restart "
            f"could read the dead group's addresses from it (its agents count restarts differently): "
            f"export {envvars.FRESH_RDZV_STORE}=1 before torchrun on every node (docs/clusters.md)")
    attempt = envvars.restart_attempt()
    if attempt == 0:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"ddp_tutorial/attempt{attempt}", store)


def group_attempt(env) -> int:
    """The restart attempt every rank agrees on (after step 1, ``env`` its ``DistEnv``): the
    largest of their agents' counts. An agent whose workers failed counts each restart, so the
    largest is above 0 after any failure on every node (one agent's own says 0 on healthy nodes)."""
    attempt = envvars.restart_attempt()
    if not env.distributed or int(os.environ.get(envvars.MAX_RESTARTS, 0)) == 0:
        return attempt  # no restart can have happened, or only this process counts
    count = torch.tensor([attempt], device=env.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@dataclass
class Fault:
    """A failure to inject: ``rank`` fails at micro-step ``step`` (counted over the whole run), on
    the first attempt only, by ``mode``: "raise" an exception, "exit" with code 3, or "hang"."""

    step: int
    rank: int = 0
    mode: str = "raise"

    def fire_if_due(self, rank: int, step: int, attempt: int) -> None:
        """Fail if this is the step and rank, and the group's ``attempt`` (``group_attempt``) is the
        first: a transient fault."""
        if step != self.step or rank != self.rank or attempt > 0:
            return
        print(f"injected failure ({self.mode}) at step {step}", flush=True)
        if self.mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if self.mode == "exit":
            sys.exit(3)
        while True:  # "hang": the other ranks wait for this one in their next all-reduce
            time.sleep(3600)
