"""Where a step record's times come from: torch's own hooks, so the lesson code carries no timers
(a DDP comm hook, a forward hook and an optimizer step pre-hook)."""

from __future__ import annotations

import time
from typing import Any, Dict

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class SyncTimer:
    """A DDP comm hook that all-reduces like DDP's default hook, and times it: from the first
    bucket's all-reduce launch to the last one's completion, the wait for the slowest rank inside.
    ``ddp_model.register_comm_hook(timer, SyncTimer.hook)``; ``total_bytes``: bytes all-reduced."""

    def __init__(self):
        self.total_s = 0.0
        self.total_bytes = 0
        self.start_step()

    def start_step(self):
        self.calls, self.first_start, self.last_end = 0, None, None

    def finish_step(self, step_t0: float):
        """Returns (sync seconds, offset of sync start from step start, all-reduce calls)."""
        if self.calls == 0:
            return 0.0, None, 0
        sync_s = self.last_end - self.first_start
        self.total_s += sync_s
        return sync_s, self.first_start - step_t0, self.calls

    def _done(self, fut):
        self.last_end = time.perf_counter()
        return fut.value()[0]

    @staticmethod
    def hook(state: "SyncTimer", bucket):
        if state.calls == 0:
            state.first_start = time.perf_counter()
        state.calls += 1
        tensor = bucket.buffer()
        state.total_bytes += tensor.numel() * tensor.element_size()
        tensor.div_(dist.get_world_size())  # as DDP's default allreduce_hook: average, then sum
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        return fut.then(state._done)


class StepTimer:
    """The phases of each micro-step, timed by hooks on the model and its optimizer. Holds neither
    (they hold the hooks): the DDP model and its group go away when train.py drops them."""

    def __init__(self, model: nn.Module, optimizer):
        self.sync = SyncTimer()  # without DDP nothing calls it: no sync time, no all-reduces
        if isinstance(model, DDP):
            model.register_comm_hook(self.sync, SyncTimer.hook)
        model.register_forward_hook(self._forward_done)
        optimizer.register_step_pre_hook(self._backward_done)
        self.t_start = self.t0 = self.t1 = self.t_forward = self.t_backward = 0.0

    def _forward_done(self, *_) -> None:
        self.t_forward = time.perf_counter()

    def _backward_done(self, *_) -> None:  # the optimizer step starts when backward is over
        self.t_backward = time.perf_counter()

    def start(self) -> None:
        self.t_start, self.t0 = time.time(), time.perf_counter()

    def compute_starts(self) -> None:  # after any straggler delay
        self.t1 = self.t_forward = self.t_backward = time.perf_counter()
        self.sync.start_step()

    def stop(self, sync: bool) -> Dict[str, Any]:
        """The micro-step's timing fields; ``sync``: it ended with an optimizer step."""
        t4 = time.perf_counter()
        t3 = self.t_backward if sync else t4  # without an optimizer step, backward ended just now
        sync_s, sync_offset_s, calls = self.sync.finish_step(self.t0)
        return {"t_start": self.t_start, "straggler_s": self.t1 - self.t0,
                "forward_s": self.t_forward - self.t1, "backward_s": t3 - self.t_forward,
                "optimizer_s": t4 - t3, "step_s": t4 - self.t0, "sync_s": sync_s,
                "sync_offset_s": sync_offset_s, "allreduce_calls": calls}
