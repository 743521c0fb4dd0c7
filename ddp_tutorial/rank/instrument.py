"""``Instrument``: the ``Hooks`` (``rank/hooks.py``) ``python -m ddp_tutorial.train`` runs with.
One record per micro-step in ``<out>/rank<R>.jsonl`` (times: ``rank/timing.py``), straggler
delays, faults (``rank/restarts.py``), checkpoints, and at the end ``model.pt`` and a summary."""

from __future__ import annotations

import os
import random
import time
import weakref
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.checkpoint import POSITION, Checkpointer, save_checkpoint, unwrap
from ddp_tutorial.rank.hooks import Hooks
from ddp_tutorial.rank.restarts import Fault, group_attempt, restart_safe_store
from ddp_tutorial.rank.timing import StepTimer
from ddp_tutorial.runfolder import MetricsWriter


def param_checksum(model: nn.Module) -> float:
    """The sum of every parameter: equal on every rank that DDP keeps in step."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def ddp_logging(model) -> dict:
    """DDP's own counters: times in ns, bucket sizes (empty without DDP)."""
    if not isinstance(model, DDP):
        return {}
    data = model._get_ddp_logging_data()
    keys = ["avg_backward_comm_time", "avg_backward_compute_time",
            "avg_backward_compute_comm_overlap_time", "avg_forward_compute_time",
            "bucket_sizes", "rebuilt_bucket_sizes", "num_buckets_reduced"]
    return {k: data[k] for k in keys if k in data}


class Instrument(Hooks):
    """``out`` (None: no files) gets rank 0's ``model.pt`` and, with ``record_steps``, the records,
    unless ``records`` (anything with ``write(record)``) takes them; without records nothing is
    timed. ``straggler_ms``: each micro-step first sleeps a random 0..N ms, as the original did."""

    def __init__(self, out: Optional[str] = None, *, records=None, record_steps: bool = True,
                 seed: int = 0, straggler_ms: float = 0.0, fault: Optional[Fault] = None,
                 checkpointer: Optional[Checkpointer] = None, batch_size: Optional[int] = None,
                 accum_steps: int = 1, bugs: Sequence[str] = (), verbose: bool = False):
        self.out, self.records, self.record_steps = out, records, record_steps
        self.seed, self.straggler_ms = seed, straggler_ms
        self.fault, self.checkpointer = fault, checkpointer
        self.batch_size, self.accum_steps = batch_size, accum_steps
        self.bugs, self.verbose = sorted(bugs), verbose
        self.timer: Optional[StepTimer] = None
        self.counters = {"step": 0, "optimizer_steps": 0}
        self.resume_at = (0, 0)  # (epoch, micro-batch) to start at: 0, or a checkpoint's
        self.losses, self.last_loss = [], float("nan")

    @classmethod
    def from_args(cls, args) -> "Instrument":
        """The hooks ``python -m ddp_tutorial.train`` runs with, from its parsed flags."""
        fault = (None if args.fail_at_step is None
                 else Fault(args.fail_at_step, args.fail_rank, args.fail_mode))
        checkpointer = (None if args.checkpoint is None
                        else Checkpointer(args.checkpoint, args.save_every, args))
        return cls(args.out, record_steps=not args.no_metrics, seed=args.seed,
                   straggler_ms=args.straggler_ms, fault=fault, checkpointer=checkpointer,
                   batch_size=args.batch_size, accum_steps=args.accum_steps, bugs=args.bug,
                   verbose=True)

    def store(self, timeout_s: float) -> Optional[dist.Store]:
        return restart_safe_store(timeout_s)

    def start(self, env, model, optimizer, num_batches: int) -> int:
        self.env, self.optimizer, self.num_batches = env, optimizer, num_batches
        # A weak reference: train.main drops its DDP model (and its group) before
        # destroy_process_group, and nothing here may keep it alive longer.
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self.rng = random.Random(f"straggler delays, seed {self.seed}, rank {env.rank}")
        self.attempt = group_attempt(env)
        if not self.record_steps:
            self.records = None
        elif self.records is None and self.out is not None:
            self.records = MetricsWriter(self.out, env.rank, fresh=self.attempt == 0,
                                         attempt=self.attempt)
        if self.records is not None:  # without records nothing is timed
            self.timer = StepTimer(model, optimizer)
        if self.checkpointer is not None:
            self._resume()
        n, k = num_batches, self.accum_steps
        if self.verbose and env.rank == 0:  # one rank speaks for the group until the summary
            if n % k:
                print(f"note: {n} micro-batches per epoch is not a multiple of K={k}; "
                      f"the last window steps after {n % k}", flush=True)
            print(f"start: backend={env.backend} device={env.device} world_size={env.world_size}, "
                  f"{n} micro-batches of {self.batch_size} per rank per epoch, K={k}"
                  + (f", bugs={self.bugs}" if self.bugs else ""), flush=True)
        self.t_train = time.perf_counter()
        return self.resume_at[0]

    def _resume(self) -> None:
        saved = self.checkpointer.resume(self.env, self._model(), self.optimizer)
        if saved is None:
            return
        self.counters = {"step": saved["step"], "optimizer_steps": saved["optimizer_steps"]}
        self.resume_at = (saved["epoch"], saved["micro"])
        self._write({"kind": "resume", **{k: saved[k] for k in POSITION},
                     "checkpoint": str(self.checkpointer.path)})
        if self.env.rank == 0:
            print(f"resumed from {self.checkpointer.path} (attempt {self.attempt}): epoch "
                  f"{saved['epoch']}, {saved['micro']} micro-batches done in it, step "
                  f"{saved['step']}", flush=True)

    def before_micro_step(self, epoch: int, micro: int) -> bool:
        if (epoch, micro) < self.resume_at:
            return False  # trained before the checkpoint (the order depends on seed + epoch only)
        if self.fault is not None:
            self.fault.fire_if_due(self.env.rank, self.counters["step"], self.attempt)
        if self.timer is not None:
            self.timer.start()
        if self.straggler_ms > 0:
            time.sleep(self.rng.uniform(0.0, self.straggler_ms) / 1e3)
        if self.timer is not None:
            self.timer.compute_starts()
        return True

    def after_micro_step(self, epoch: int, micro: int, sync: bool, loss: torch.Tensor) -> None:
        times = self.timer.stop(sync) if self.timer is not None else {}
        step = self.counters["step"]
        self.counters["step"] += 1
        self.counters["optimizer_steps"] += int(sync)
        self.last_loss = loss.item()
        self.losses.append(self.last_loss)
        self._write({"kind": "step", "epoch": epoch, "step": step, "micro": micro, "sync": sync,
                     "optimizer_step": sync, "loss": self.last_loss, **times})
        if sync and self.checkpointer is not None:  # at a window's end: no half-summed gradients
            saved = self.checkpointer.save_if_due(self.env, self._model(), self.optimizer,
                                                  self.counters, epoch, micro + 1, self.num_batches)
            if saved is not None:
                self._write({"kind": "checkpoint", **saved})
        if micro + 1 == self.num_batches:
            if self.verbose and self.env.rank == 0:
                print(f"epoch {epoch}: mean local loss {sum(self.losses) / len(self.losses):.4f}, "
                      f"{self.counters['optimizer_steps']} optimizer steps so far", flush=True)
            self.losses = []

    def _write(self, record: Dict[str, Any]) -> None:
        if self.records is not None:
            self.records.write({"kind": record.pop("kind"), "rank": self.env.rank,
                                "attempt": self.attempt, **record})

    def finish(self, model) -> None:
        wall = time.perf_counter() - self.t_train
        module = unwrap(model)
        if self.out is not None and self.env.rank == 0:
            save_checkpoint({k: v.cpu() for k, v in module.state_dict().items()},
                            os.path.join(self.out, "model.pt"))
        env, counters = self.env, self.counters
        self._write({"kind": "summary", "world_size": env.world_size, "backend": env.backend,
                     "device": str(env.device), "bugs": self.bugs, "micro_steps": counters["step"],
                     "optimizer_steps": counters["optimizer_steps"], "train_seconds": wall,
                     "threads": torch.get_num_threads(), "param_checksum": param_checksum(module),
                     "ddp_logging": ddp_logging(model)})
        if isinstance(self.records, MetricsWriter):
            self.records.close()
        if self.verbose:
            sync_ms = self.timer.sync.total_s * 1e3 if self.timer else 0.0
            print(f"done: {counters['step']} micro-steps, {counters['optimizer_steps']} optimizer "
                  f"steps, final loss {self.last_loss:.4f}, {wall:.2f} s, of which sync "
                  f"{sync_ms:.0f} ms", flush=True)
