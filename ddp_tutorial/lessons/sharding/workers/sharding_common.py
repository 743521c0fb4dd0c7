"""What the labs share (rank side): the parts' main, models, bytes held (this rank's: a DTensor's
local shard, ZeRO's local optimizer's state), and a log of collectives."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterable, List

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_tutorial.lessons.pitfalls.workers.pitfall_common import flags, run

#: The collectives the log records: the name and position of their full-size tensor argument.
FULL_TENSOR = {"all_reduce": ("tensor", 0), "broadcast": ("tensor", 0),
               "all_gather_single": ("output_tensor", 0),
               "all_gather_into_tensor": ("output_tensor", 0),
               "reduce_scatter_single": ("input", 1), "reduce_scatter_tensor": ("input", 1)}
#: torch 2.9's names (FSDP2 calls them there), recorded under torch 2.13's.
NEWER_NAME = {"all_gather_into_tensor": "all_gather_single",
              "reduce_scatter_tensor": "reduce_scatter_single"}


def run_parts(doc: str, parts: Dict[str, Callable], default: str, **defaults) -> None:
    """A lab's main: ``parts[name](args, rank, world_size)`` for each name of ``--parts``
    (comma-separated, ``default``), in order; rank 0 prints each one's time (live progress)."""
    p = flags(doc, **defaults)
    p.add_argument("--parts", default=default, help="comma-separated: " + ", ".join(parts))

    def body(args, rank, world_size):
        wanted = [part for part in args.parts.split(",") if part]
        unknown = [part for part in wanted if part not in parts]
        if unknown:
            raise SystemExit(f"no part(s) {unknown}; the parts are {', '.join(parts)}")
        for part in wanted:
            t0 = time.perf_counter()
            parts[part](args, rank, world_size)
            if rank == 0:
                print(f"{part}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    run(body, p)


def mlp(d_in: int, hidden: int, d_out: int, seed: int) -> nn.Sequential:
    """A two-layer MLP with weights from ``seed``: every rank builds the same one."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard, else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors`` (shards only, for sharded ones)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO's local one, else ``optimizer`` itself."""
    return getattr(optimizer, "optim", optimizer)


def state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every state tensor this rank's optimizer holds (Adam: exp_avg, exp_avg_sq, step)."""
    return [v for state in optimizer_state(optimizer).state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def held(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes and elements of parameters, gradients and optimizer state this rank holds now."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = state_tensors(optimizer)
    counts = {}
    for kind, tensors in (("param", params), ("grad", grads), ("state", states)):
        counts[f"{kind}_bytes"] = nbytes(tensors)
        counts[f"{kind}_elements"] = sum(local(t).numel() for t in tensors)
    return {**counts, "state_tensors": len(states), "param_tensors": len(params)}


def full_parameters(model: nn.Module) -> List[torch.Tensor]:
    """The whole parameters, gathered if sharded (a collective for FSDP2: call it on every rank)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for p in model.parameters()]


class CollectiveLog:
    """Each ``FULL_TENSOR`` collective called as ``dist.<name>(...)`` (DDP without a comm hook
    all-reduces in C++, unseen): op, dtype, elements, bytes, launch, and an all-reduce's completion
    (perf_counter; an async one's when its future completes, on gloo's thread)."""

    def __init__(self):
        self.calls: List[dict] = []
        self._saved = {}

    def _wrap(self, name, fn):
        key, pos = FULL_TENSOR[name]

        def recorded(*args, **kwargs):
            t = kwargs[key] if key in kwargs else args[pos]
            rec = {"op": NEWER_NAME.get(name, name), "dtype": str(t.dtype).replace("torch.", ""),
                   "elements": t.numel(), "bytes": t.numel() * t.element_size(),
                   "launch": time.perf_counter()}
            self.calls.append(rec)
            work = fn(*args, **kwargs)
            if name == "all_reduce" and work is None:
                rec["done"] = time.perf_counter()
            elif name == "all_reduce":
                work.get_future().then(lambda _: rec.__setitem__("done", time.perf_counter()))
            return work
        return recorded

    @contextlib.contextmanager
    def recording(self):
        """Record while inside the ``with`` block; the originals are back after it."""
        for name in (n for n in FULL_TENSOR if hasattr(dist, n)):  # torch 2.9 lacks the newer names
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        try:
            yield self
        finally:
            for name, fn in self._saved.items():
                setattr(dist, name, fn)
            self._saved.clear()

    def take(self) -> List[dict]:
        """The calls recorded since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls
