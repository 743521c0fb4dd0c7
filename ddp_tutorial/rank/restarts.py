"""Restarts and faults: a rendezvous store a restarted group can use, the attempt all ranks
agree on, and the transient fault ``--fail-at-step`` injects on the first attempt only.

``torchrun --max-restarts`` (or ``launch(max_restarts=...)``) starts the whole group
again with ``TORCHELASTIC_RESTART_COUNT`` raised; train.py then resumes from its
checkpoint (``rank/checkpoint.py``). ``Instrument`` (``rank/instrument.py``) calls these.
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

    torchrun's agent hosts one TCPStore for the whole job and keeps it across
    restarts (torch 2.13: ``DynamicRendezvousHandler.next_rendezvous`` in
    ``elastic/rendezvous/dynamic_rendezvous.py`` creates ``_shared_tcp_store_server``
    only at the first rendezvous), and env:// connects each worker to it without
    a per-attempt prefix (``rendezvous._create_c10d_store``). A restarted gloo
    group then reads the dead group's addresses ("Gloo connectFullMesh failed ...
    Connection refused", pytorch/pytorch#135712). With one agent (``launch``, or
    torchrun on one node) every rank has the same ``TORCHELASTIC_RESTART_COUNT``,
    and a prefix per attempt hides the old keys.

    With several agents the counts differ. ``SimpleElasticAgent._invoke_run``
    (``elastic/agent/server/api.py``) uses up a restart only when its own
    workers failed; an agent whose workers are healthy sees
    ``num_nodes_waiting() > 0`` and calls ``_restart_workers`` ("membership
    changes do not count as retries"), and ``LocalElasticAgent._start_workers``
    passes ``max_restarts - _remaining_restarts`` as the count. The round number
    (``_wrap_store``'s prefix) stays in the agent: no value that every rank of a
    round shares reaches the workers, so no prefix can be safe there.
    With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` the agent shares no store:
    every round publishes a fresh port and worker rank 0 hosts a new store on
    it (``next_rendezvous``' opt-out branch, ``RendezvousStoreInfo.build``), so
    no old key can be read. A multi-node job that may restart without it is refused.

    Args:
        timeout_s: how long a store operation may wait.

    Raises:
        RuntimeError: several agents, restarts allowed, and the agents' shared store.
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
    """The restart attempt every rank of the group agrees on: the largest of their agents' counts.

    Called after step 1. An agent whose workers failed counts each restart, so
    the largest count is above 0 after any failure, on every rank, whichever
    node it runs on (one agent's own count would say 0 on the healthy nodes).

    Args:
        env: step 1's ``DistEnv``.
    """
    attempt = envvars.restart_attempt()
    if not env.distributed or int(os.environ.get(envvars.MAX_RESTARTS, 0)) == 0:
        return attempt  # no restart can have happened, or only this process counts
    count = torch.tensor([attempt], device=env.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@dataclass
class Fault:
    """A failure to inject: ``rank`` fails at micro-step ``step``, on the first attempt only.

    Attributes:
        step: the micro-step (counted over the whole run) at which to fail.
        rank: the rank that fails.
        mode: "raise" an exception, "exit" with code 3, or "hang" (sleep forever).
    """

    step: int
    rank: int = 0
    mode: str = "raise"

    def fire_if_due(self, rank: int, step: int, attempt: Optional[int] = None) -> None:
        """Fail if this is the step and rank, and no restart has happened yet (a transient fault).

        Args:
            attempt: the group's restart attempt (``group_attempt``); None reads this agent's count.
        """
        if attempt is None:
            attempt = envvars.restart_attempt()
        if step != self.step or rank != self.rank or attempt > 0:
            return
        print(f"injected failure ({self.mode}) at step {step}", flush=True)
        if self.mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        if self.mode == "exit":
            sys.exit(3)
        while True:  # "hang": the other ranks wait for this one in their next all-reduce
            time.sleep(3600)
