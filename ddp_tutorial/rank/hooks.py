"""The one interface between train.py and the kit: five callbacks, each a no-op here.

With ``NO_HOOKS`` train.py is a plain DDP program; ``Instrument``
(``rank/instrument.py``), which ``python -m ddp_tutorial.train`` uses, records,
checkpoints and restarts through the same five calls. In the order train.py makes them::

    store = hooks.store(timeout_s)                       # step 1's rendezvous (None: env://)
    first_epoch = hooks.start(env, model, optimizer, num_batches)      # after steps 1-3
    for epoch ...: for each micro-batch i:
        if hooks.before_micro_step(epoch, i):            # False: a resumed run trained it already
            ... forward, backward, optimizer step on sync ...
            hooks.after_micro_step(epoch, i, sync, loss)
    hooks.finish(model)                                  # before step 5
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn


class Hooks:
    """The kit's interface to train.py: five callbacks, each a no-op here."""

    def store(self, timeout_s: float) -> Optional[dist.Store]:
        """The store for step 1's rendezvous; None means the usual env:// (MASTER_ADDR:MASTER_PORT)."""
        return None

    def start(self, env, model: nn.Module, optimizer, num_batches: int) -> int:
        """Called after steps 1-3; returns the epoch to start from (a resumed run's, else 0).

        Args:
            env: step 1's ``DistEnv``.
            model: the wrapped model of step 2.
            optimizer: its optimizer.
            num_batches: micro-batches per epoch on this rank.
        """
        return 0

    def before_micro_step(self, epoch: int, micro: int) -> bool:
        """Before micro-batch ``micro`` of ``epoch``; False skips it (trained before a checkpoint)."""
        return True

    def after_micro_step(self, epoch: int, micro: int, sync: bool, loss: torch.Tensor) -> None:
        """After the micro-batch and, when ``sync``, the optimizer step."""

    def finish(self, model: nn.Module) -> None:
        """After the last epoch, before step 5."""


NO_HOOKS = Hooks()
