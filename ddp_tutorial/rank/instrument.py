"""What the kit measures and wires around train.py's five steps, through one small interface.

train.py calls a ``Hooks`` object at five points. The base class does nothing,
so with the default hooks train.py is a plain DDP program. ``Instrument``, which
``python -m ddp_tutorial.train`` uses, adds:

- one record per micro-step in ``<out>/rank<R>.jsonl`` (loss, timings, all-reduces),
  timed with torch's own hooks (a forward hook, an optimizer step pre-hook) and
  ``SyncTimer`` (a DDP comm hook), so the lesson code carries no timers;
- straggler delays (``--straggler-ms``) and fault injection (``--fail-at-step``);
- checkpoint and exact resume (``--checkpoint``, ``--save-every``);
- a rendezvous store that survives torchrun restarts (``restart_safe_store``).

The calls, in the order train.py makes them::

    store = hooks.store(timeout_s)                       # step 1's rendezvous (None: env://)
    first_epoch = hooks.start(env, model, optimizer, num_batches)      # after steps 1-3
    for epoch ...: for each micro-batch i:
        if hooks.before_micro_step(epoch, i):            # False: a resumed run trained it already
            ... forward, backward, optimizer step on sync ...
            hooks.after_micro_step(epoch, i, sync, loss)
    hooks.finish(model)                                  # before step 5
"""

from __future__ import annotations

import datetime
import os
import random
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_tutorial.rank.checkpoint import SETTINGS, load_checkpoint, save_checkpoint
from ddp_tutorial import envvars
from ddp_tutorial.runfolder import MetricsWriter

#: What must match between a checkpoint and the run resuming from it: the
#: position in an epoch names the same samples only for the same split.
CHECKPOINT_SETTINGS = SETTINGS


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


# -- Sync timing --------------------------------------------------------------
class SyncTimer:
    """A DDP comm hook that all-reduces like DDP's default hook, and times it.

    ``sync_s`` of a step runs from the first bucket's all-reduce launch to the
    last one's completion: the wait for the slowest rank is inside it.
    ``total_bytes`` counts the gradient bytes all-reduced, every call.

        timer = SyncTimer()
        ddp_model.register_comm_hook(timer, SyncTimer.hook)
    """

    def __init__(self):
        self.process_group = None
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
        now = time.perf_counter()
        if state.calls == 0:
            state.first_start = now
        state.calls += 1
        group = state.process_group or dist.group.WORLD
        tensor = bucket.buffer()
        state.total_bytes += tensor.numel() * tensor.element_size()
        tensor.div_(group.size())  # as DDP's default allreduce_hook: average, then sum
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return fut.then(state._done)


# -- Restarts and faults --------------------------------------------------------


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
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
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


# -- Checkpoints ----------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (what to save, load or inspect)."""
    return model.module if isinstance(model, DDP) else model


def checkpoint_state(model, optimizer, settings: Dict[str, Any], counters: Dict[str, int], epoch: int,
                     micro_done: int, num_batches: int) -> Dict[str, Any]:
    """What a checkpoint holds: model, optimizer (momentum), and where training stands.

    Args:
        model: the (wrapped) model.
        optimizer: its optimizer.
        settings: this run's values of ``CHECKPOINT_SETTINGS``.
        counters: ``step`` (micro-steps done) and ``optimizer_steps``.
        epoch: the epoch being trained.
        micro_done: micro-batches of ``epoch`` trained; a finished epoch is stored
            as the start of the next one.
        num_batches: micro-batches per epoch.
    """
    if micro_done >= num_batches:
        epoch, micro_done = epoch + 1, 0
    return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": epoch, "micro": micro_done, "step": counters["step"],
            "optimizer_steps": counters["optimizer_steps"], **settings}


def resume_from_checkpoint(path, model, optimizer, settings: Dict[str, Any], device) -> Optional[Dict]:
    """Load ``path`` into model and optimizer if it exists; returns the checkpoint, or None.

    Every rank loads the file itself, with ``map_location`` set to its own
    device (a checkpoint written from ``cuda:0`` must not land on ``cuda:0`` everywhere).

    Raises:
        ValueError: the checkpoint was made with other settings (world size, batch size, K, ...).
    """
    saved = load_checkpoint(path, map_location=device)
    if saved is None:
        return None
    differ = {k: (saved[k], v) for k, v in settings.items() if saved[k] != v}
    if differ:
        raise ValueError(f"checkpoint {path} was made with different settings (saved, now): {differ}; "
                         "its position in the epoch would name other samples. Resume with the same "
                         "settings, or start from a new --checkpoint")
    unwrap(model).load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return saved


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


# -- The kit's hooks --------------------------------------------------------------
class Instrument(Hooks):
    """Records, straggler delays, faults, checkpoints and restarts around train.py's steps.

    Args:
        out: run folder for rank 0's ``model.pt`` and, with ``record_steps``, ``rank<R>.jsonl``;
            None writes no files.
        records: where the records go instead of ``rank<R>.jsonl`` (anything with ``write(record)``).
        record_steps: time each micro-step and write a record of it (and the run's events);
            without records nothing is timed.
        seed: seeds the straggler delays (with the rank).
        straggler_ms: each micro-step first sleeps a random 0..straggler_ms ms, like the
            original demo's ``time.sleep(random.random())``.
        fault: a failure to inject, or None.
        checkpoint: resume from this file if it exists, and save there; None: never.
        save_every: also save every N optimizer steps (0: at epoch ends only).
        settings: what a checkpoint must match (``CHECKPOINT_SETTINGS`` except world_size).
        bugs: the ``--bug`` names in effect, for the summary record.
        verbose: print the start, per-epoch and final lines.
    """

    def __init__(self, out: Optional[str] = None, *, records=None, record_steps: bool = True, seed: int = 0,
                 straggler_ms: float = 0.0, fault: Optional[Fault] = None,
                 checkpoint: Optional[str] = None, save_every: int = 0,
                 settings: Optional[Dict[str, Any]] = None, bugs: Sequence[str] = (),
                 verbose: bool = False):
        self.out, self.records, self.record_steps = out, records, record_steps
        self.seed, self.straggler_ms = seed, straggler_ms
        self.fault, self.checkpoint, self.save_every = fault, checkpoint, save_every
        self.settings, self.bugs, self.verbose = dict(settings or {}), sorted(bugs), verbose
        self.attempt = envvars.restart_attempt()
        self.timer: Optional[SyncTimer] = None
        self.counters = {"step": 0, "optimizer_steps": 0}
        self.resume_at = (0, 0)  # (epoch, micro-batch) to start at: the beginning, or a checkpoint's
        self.losses, self.last_loss = [], float("nan")

    @classmethod
    def from_args(cls, args) -> "Instrument":
        """The hooks ``python -m ddp_tutorial.train`` runs with, from its parsed flags."""
        fault = None if args.fail_at_step is None else Fault(args.fail_at_step, args.fail_rank,
                                                              args.fail_mode)
        settings = {"batch_size": args.batch_size, "accum_steps": args.accum_steps,
                    "dataset_size": args.dataset_size, "seed": args.seed}
        return cls(args.out, record_steps=not args.no_metrics, seed=args.seed,
                   straggler_ms=args.straggler_ms, fault=fault, checkpoint=args.checkpoint,
                   save_every=args.save_every, settings=settings, bugs=args.bug, verbose=True)

    def store(self, timeout_s: float) -> Optional[dist.Store]:
        return restart_safe_store(timeout_s)

    def start(self, env, model, optimizer, num_batches: int) -> int:
        self.env, self.optimizer, self.num_batches = env, optimizer, num_batches
        # Not a reference that keeps the DDP model (and its process group) alive: train.main
        # drops its model before destroy_process_group, and nothing here may hold it longer.
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self.rng = random.Random(f"straggler delays, seed {self.seed}, rank {env.rank}")  # one stream per rank
        self.attempt = group_attempt(env)  # this agent's count may be 0 on a restarted multi-node group
        if not self.record_steps:
            self.records = None
        elif self.records is None and self.out is not None:
            self.records = MetricsWriter(self.out, env.rank, fresh=self.attempt == 0, attempt=self.attempt)
        if self.records is not None:
            self._time_steps(model, optimizer)
        self._resume()
        if self.verbose and env.rank == 0:  # one rank speaks for the group until the summary
            self._announce()
        self.t_train = time.perf_counter()
        return self.resume_at[0]

    def _time_steps(self, model, optimizer) -> None:
        """Timestamps from torch's own hooks: forward's end, the optimizer step's start, the all-reduces."""
        if isinstance(model, DDP):
            self.timer = SyncTimer()
            model.register_comm_hook(self.timer, SyncTimer.hook)
        model.register_forward_hook(lambda *_: setattr(self, "t_forward", time.perf_counter()))
        optimizer.register_step_pre_hook(lambda *_: setattr(self, "t_backward", time.perf_counter()))

    def _resume(self) -> None:
        if self.checkpoint is None:
            return
        settings = {"world_size": self.env.world_size, **self.settings}
        saved = resume_from_checkpoint(self.checkpoint, self._model(), self.optimizer, settings,
                                       self.env.device)
        if saved is None:
            return
        self.counters = {"step": saved["step"], "optimizer_steps": saved["optimizer_steps"]}
        self.resume_at = (saved["epoch"], saved["micro"])
        self._write({"kind": "resume", "step": saved["step"], "epoch": saved["epoch"],
                     "micro": saved["micro"], "optimizer_steps": saved["optimizer_steps"],
                     "checkpoint": str(self.checkpoint)})
        if self.env.rank == 0:
            print(f"resumed from {self.checkpoint} (attempt {self.attempt}): epoch {saved['epoch']}, "
                  f"{saved['micro']} micro-batches done in it, step {saved['step']}", flush=True)

    def _announce(self) -> None:
        n, k = self.num_batches, self.settings.get("accum_steps", 1)
        if n % k:
            print(f"note: {n} micro-batches per epoch is not a multiple of K={k}; "
                  f"the last window steps after {n % k}", flush=True)
        env = self.env
        print(f"start: backend={env.backend} device={env.device} world_size={env.world_size}, "
              f"{n} micro-batches of {self.settings.get('batch_size')} per rank per epoch, K={k}"
              + (f", bugs={self.bugs}" if self.bugs else ""), flush=True)

    def before_micro_step(self, epoch: int, micro: int) -> bool:
        if (epoch, micro) < self.resume_at:
            # Trained before the checkpoint. The sampler's order depends only on
            # seed + epoch, so skipping here leaves exactly the samples that followed.
            return False
        if self.fault is not None:
            self.fault.fire_if_due(self.env.rank, self.counters["step"], self.attempt)
        self.t_start, self.t0 = time.time(), time.perf_counter()
        if self.straggler_ms > 0:
            time.sleep(self.rng.uniform(0.0, self.straggler_ms) / 1e3)
        self.t1 = self.t_forward = self.t_backward = time.perf_counter()
        if self.timer is not None:
            self.timer.start_step()
        return True

    def after_micro_step(self, epoch: int, micro: int, sync: bool, loss: torch.Tensor) -> None:
        t4 = time.perf_counter()
        t3 = self.t_backward if sync else t4  # without an optimizer step, backward ended just now
        step = self.counters["step"]
        self.counters["step"] += 1
        self.counters["optimizer_steps"] += int(sync)
        self.last_loss = loss.item()
        self.losses.append(self.last_loss)
        if self.records is not None:
            sync_s, sync_offset_s, calls = self.timer.finish_step(self.t0) if self.timer else (0.0, None, 0)
            self._write({"kind": "step", "epoch": epoch, "step": step, "micro": micro, "sync": sync,
                         "optimizer_step": sync, "loss": self.last_loss, "t_start": self.t_start,
                         "straggler_s": self.t1 - self.t0, "forward_s": self.t_forward - self.t1,
                         "backward_s": t3 - self.t_forward, "optimizer_s": t4 - t3, "step_s": t4 - self.t0,
                         "sync_s": sync_s, "sync_offset_s": sync_offset_s, "allreduce_calls": calls})
        if sync:  # only at the end of an accumulation window: no half-summed gradients to lose
            self.maybe_save_checkpoint(epoch, micro + 1)
        if micro + 1 == self.num_batches:
            if self.verbose and self.env.rank == 0:
                print(f"epoch {epoch}: mean local loss {sum(self.losses) / len(self.losses):.4f}, "
                      f"{self.counters['optimizer_steps']} optimizer steps so far", flush=True)
            self.losses = []

    def maybe_save_checkpoint(self, epoch: int, micro_done: int) -> None:
        """Rank 0 saves every ``save_every`` optimizer steps and at epoch ends; all ranks then meet.

        Every rank takes the same decision (same step counts), then waits at a
        barrier, so no rank runs ahead of a checkpoint that is not yet on disk.
        """
        if self.checkpoint is None:
            return
        due = bool(self.save_every) and self.counters["optimizer_steps"] % self.save_every == 0
        if not (due or micro_done >= self.num_batches):
            return
        settings = {"world_size": self.env.world_size, **self.settings}
        saved = checkpoint_state(self._model(), self.optimizer, settings, self.counters, epoch, micro_done,
                                 self.num_batches)
        if self.env.rank == 0:
            save_checkpoint(saved, self.checkpoint)  # atomic: tmp file, fsync, os.replace
        if self.env.distributed:
            dist.barrier()
        self._write({"kind": "checkpoint", "step": self.counters["step"], "epoch": saved["epoch"],
                     "micro": saved["micro"], "optimizer_steps": self.counters["optimizer_steps"]})

    def _write(self, record: Dict[str, Any]) -> None:
        if self.records is not None:
            self.records.write({"kind": record.pop("kind"), "rank": self.env.rank, "attempt": self.attempt,
                                **record})

    def finish(self, model) -> None:
        wall = time.perf_counter() - self.t_train
        module = unwrap(model)
        if self.out is not None and self.env.rank == 0:
            # Atomically, like a checkpoint: a reader never sees half a model.pt.
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
            sync_ms = self.timer.total_s * 1e3 if self.timer else 0.0
            print(f"done: {counters['step']} micro-steps, {counters['optimizer_steps']} optimizer steps, "
                  f"final loss {self.last_loss:.4f}, {wall:.2f} s, of which sync {sync_ms:.0f} ms",
                  flush=True)
