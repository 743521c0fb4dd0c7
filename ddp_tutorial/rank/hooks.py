"""The one interface between train.py and the kit: five callbacks, each a no-op here, so with
``NO_HOOKS`` train.py is plain DDP. ``Instrument`` (``rank/instrument.py``) records, checkpoints and
restarts through them; train.py calls them in the order they are defined."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class Hooks:
    def store(self, timeout_s: float) -> dist.Store | None:
        """The store for step 1's rendezvous; None: the usual env:// (MASTER_ADDR:MASTER_PORT)."""
        return None

    def start(self, env, model: nn.Module, optimizer, num_batches: int) -> int:
        """After steps 1-3 (``num_batches`` per epoch on this rank); returns the epoch to start
        from (a resumed run's, else 0)."""
        return 0

    def before_micro_step(self, epoch: int, micro: int) -> bool:
        """Before micro-batch ``micro`` of ``epoch``; False skips it (trained before a resume)."""
        return True

    def after_micro_step(self, epoch: int, micro: int, sync: bool, loss: torch.Tensor) -> None:
        """After the micro-batch and, when ``sync``, the optimizer step."""

    def finish(self, model: nn.Module) -> None:
        """After the last epoch, before step 5."""


NO_HOOKS = Hooks()
