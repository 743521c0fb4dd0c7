"""The harness of exercise "shard": the common harness, plus what a ZeRO-1 check must measure.

    python rank/bootstrap.py shard_harness.py shard SCRIPT

Runs SCRIPT under ``harness.run`` (its records, exit code and error as for
every exercise) with more observers installed around it:
ZeroRedundancyOptimizer's construction, ``consolidate_state_dict`` (and its
target) and ``state_dict`` calls, the optimizer states ``torch.save`` writes
to a file (each parameter's ``step`` and Adam moments, as they were when
saved), the last optimizer stepped, and whether its parameters are the DDP
model's and had gradients. Then each rank reports ``shard_final``: the Adam
state it holds at the end (by global parameter index), the learning rate, its
final parameters. Only then does rank 0 replay the original DDP script in one
process and report ``shard_reference``: a peer that fails during the replay
costs the reference, never what was measured. A rank whose script failed waits (at most
``REPORTS_WAIT_S``) until every other rank has reported too before it exits: its exit stops the
group, and a peer still finishing its script or its reports would lose them.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddp_tutorial.exercises.judge.shard import LR
from ddp_tutorial.exercises.workers import harness, observers, reference, task
from ddp_tutorial.lessons.sharding.workers.sharding_common import nbytes, optimizer_state, state_tensors
from ddp_tutorial.rank import bootstrap
from ddp_tutorial.runfolder import report

#: The longest a rank whose script failed waits for the other ranks' reports before it exits.
REPORTS_WAIT_S = 10.0

# This module runs the script for the rank (through ``harness.run``): its frames are not the script's.
globals()[bootstrap.RUNS_THE_SCRIPT] = True
#: Adam's moments, recorded by value for each parameter (the task's model is small).
MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_states_in(obj):
    """Every optimizer state dict (a dict with "state" and "param_groups") inside a saved object."""
    if isinstance(obj, dict):
        if "state" in obj and "param_groups" in obj:
            yield obj
        else:
            for value in obj.values():
                yield from optimizer_states_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from optimizer_states_in(value)


def param_state(state: dict) -> dict:
    """One parameter's Adam state as plain numbers: its step and its moments, flattened."""
    step = state.get("step")
    moments = [state[name] for name in MOMENTS if isinstance(state.get(name), torch.Tensor)]
    values = [x for m in moments for x in m.detach().reshape(-1).cpu().tolist()]
    return {"step": float(step) if step is not None else None, "values": values}


def saved_state(state_dict: dict) -> dict:
    """What an optimizer state dict holds, copied now: bytes, and each parameter's state by index."""
    tensors = [v for s in state_dict["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params_with_state": len(state_dict["state"]), "state_bytes": nbytes(tensors),
            "state": [[i, param_state(s)] for i, s in state_dict["state"].items() if isinstance(s, dict)]}


def held_state(opt) -> list:
    """The Adam state this rank holds now, as [global parameter index, state] pairs.

    The index is the parameter's position in the optimizer's parameter list, the
    indexing of ``state_dict()`` (ZeRO's consolidated one and a plain Adam's alike).
    """
    index = {id(p): i for i, p in enumerate(observers.optimizer_parameters(opt))}
    local = optimizer_state(opt)
    return [[index[id(p)], param_state(s)] for p, s in getattr(local, "state", {}).items()
            if id(p) in index and isinstance(s, dict)]


class ZeroObservers(observers.Observers):
    """What the common harness does not watch: ZeRO's calls, saved optimizer states, the last optimizer.

    ``patch`` and ``remove`` are the common harness's; ``install`` puts these observers in.
    """

    def __init__(self):
        super().__init__(seen=None, launcher=None)
        self.last_optimizer = None
        self.steps = 0  # steps of the script's own optimizer, not of ZeRO's inner Adam
        self.zeros = []  # every ZeroRedundancyOptimizer built (its inner optimizer may come later)
        self.consolidations = []  # each consolidate_state_dict call on this rank: its `to`, and when
        self.consolidating = False  # ZeRO's own torch.save of a shard into a buffer is not a checkpoint
        self.state_dict_refused = None
        self.saved = []
        self.ddp_params = set()  # ids of the parameters of the modules DDP wraps
        self.params_with_grad = 0  # the most of the optimizer's parameters that had a .grad at a step
        self.store = None  # the process group's store, kept past the script's destroy_process_group()

    def inner_optimizers(self):
        return {id(zero.optim) for zero in self.zeros if hasattr(zero, "optim")}

    def install(self):
        zero_init = ZeroRedundancyOptimizer.__init__

        def observed_init(zero, *args, **kwargs):
            zero_init(zero, *args, **kwargs)
            self.zeros.append(zero)  # zero.optim does not exist yet with overlap_with_ddp=True

        consolidate = ZeroRedundancyOptimizer.consolidate_state_dict

        def observed_consolidate(zero, to=0):
            self.consolidations.append({"to": to, "after_steps": self.steps})
            self.consolidating = True
            try:
                return consolidate(zero, to)
            finally:
                self.consolidating = False

        state_dict = ZeroRedundancyOptimizer.state_dict

        def observed_state_dict(zero):
            try:
                return state_dict(zero)
            except RuntimeError as err:  # not consolidated on this rank
                self.state_dict_refused = {"message": str(err).splitlines()[0],
                                           "consolidated_to": [c["to"] for c in self.consolidations]}
                raise

        save = torch.save

        def observed_save(obj, f, *args, **kwargs):
            if not self.consolidating:
                self.saved.extend({**saved_state(state), "after_steps": self.steps}
                                  for state in optimizer_states_in(obj))
            return save(obj, f, *args, **kwargs)

        ddp_init = DistributedDataParallel.__init__

        def observed_ddp_init(ddp, *args, **kwargs):
            ddp_init(ddp, *args, **kwargs)
            self.ddp_params.update(id(p) for p in ddp.module.parameters())
            if self.store is None and dist.is_initialized():
                self.store = dist.distributed_c10d._get_default_store()

        def after_step(optimizer, args, kwargs):
            if id(optimizer) in self.inner_optimizers():  # ZeRO's own step follows its inner Adam's
                return
            self.steps += 1
            self.last_optimizer = optimizer
            params = observers.optimizer_parameters(optimizer)
            self.params_with_grad = max(self.params_with_grad, sum(p.grad is not None for p in params))

        self.patch(ZeroRedundancyOptimizer, "__init__", observed_init)
        self.patch(ZeroRedundancyOptimizer, "consolidate_state_dict", observed_consolidate)
        self.patch(ZeroRedundancyOptimizer, "state_dict", observed_state_dict)
        self.patch(DistributedDataParallel, "__init__", observed_ddp_init)
        self.patch(torch, "save", observed_save)  # the common harness wraps this one in turn
        self._hook = register_optimizer_step_post_hook(after_step)


def ddp_replay(world_size: int, seed: int = 0):
    """The DDP script with Adam in one process: final parameters, Adam's state, steps.

    Each step computes every rank's gradient on that rank's rows (its
    DistributedSampler's order), divides by W and sums, as DDP's all-reduce
    does, then steps one Adam with lr=LR.
    """
    model = task.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    dataset = task.make_dataset()
    x_all, y_all = dataset.tensors
    steps = 0
    for epoch in range(task.EPOCHS):
        for batch in reference.micro_batches(dataset, world_size, epoch, seed):
            n = len(batch) // world_size  # the global micro-batch holds each rank's rows in turn
            summed = None
            for rows in (batch[i:i + n] for i in range(0, len(batch), n)):
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(x_all[rows]), y_all[rows]).backward()
                grads = [p.grad / world_size for p in model.parameters()]
                summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
            for p, g in zip(model.parameters(), summed):
                p.grad = g
            optimizer.step()
            steps += 1
    return reference.flat_parameters(model.parameters()), nbytes(state_tensors(optimizer)), steps


def full_state_bytes(params) -> int:
    """Bytes of one whole Adam state for tensors shaped like ``params`` (what one unsharded rank holds)."""
    copies = [torch.zeros_like(p, requires_grad=True) for p in params]
    for c in copies:
        c.grad = torch.zeros_like(c)
    adam = torch.optim.Adam(copies)
    adam.step()
    return nbytes(state_tensors(adam))


def final_record(seen: ZeroObservers) -> dict:
    """What this rank measured once the script ended; the optimizer is the last stepped, else the last ZeRO."""
    opt = seen.last_optimizer or (seen.zeros[-1] if seen.zeros else None)
    params = observers.optimizer_parameters(opt) if opt is not None else []
    local = optimizer_state(opt) if opt is not None else None
    # None: a ZeRO with overlap_with_ddp=True builds its local optimizer only in DDP's hook
    unbuilt = local is None or (local is opt and isinstance(opt, ZeroRedundancyOptimizer))
    return {"event": "shard_final", "optimizer": type(opt).__name__ if opt is not None else None,
            "local_optimizer": None if unbuilt else type(local).__name__,
            "lr": opt.param_groups[0]["lr"] if opt is not None and opt.param_groups else None,
            "state_bytes": nbytes(state_tensors(opt)) if hasattr(local, "state") else 0,
            "optimizer_steps": seen.steps, "param_tensors": len(params),
            "full_state_bytes": full_state_bytes(params) if params else 0,
            "final_params": reference.flat_parameters(params) if params else None,
            "held_state": held_state(opt) if hasattr(local, "state") else [],
            "trains_ddp_model": None if opt is None else (
                bool(params) and all(id(p) in seen.ddp_params for p in params)),
            "params_with_grad": seen.params_with_grad,
            "overlap_with_ddp": bool(getattr(opt, "_overlap_with_ddp", False)),
            "consolidations": seen.consolidations, "state_dict_refused": seen.state_dict_refused,
            "saved_optimizer_states": seen.saved}


def main(argv) -> None:
    if len(argv) != 2:
        sys.exit("usage: bootstrap.py shard_harness.py EXERCISE SCRIPT")
    seen = ZeroObservers()
    seen.install()
    failure = harness.run(argv[0], os.path.abspath(argv[1]))
    seen.remove()
    report(final_record(seen))  # first: a peer's failure stops this rank, and the replay below takes a while
    if int(os.environ.get("RANK", 0)) == 0:  # also after a failed script: the other criteria still say why
        params, state_bytes, steps = ddp_replay(int(os.environ.get("WORLD_SIZE", 1)))
        report({"event": "shard_reference", "reference": params, "reference_state_bytes": state_bytes,
                "reference_steps": steps})
    wait_for_the_others_reports(seen.store, failed=failure is not None)
    harness.end_as_the_script_did(failure)


def wait_for_the_others_reports(store, failed: bool) -> None:
    """Mark this rank's reports written; if its script failed, wait for every other rank's mark first.

    A failed rank's exit makes the launcher stop the group. Without this wait, a peer that was a
    moment behind (on a busy machine) lost its ``shard_final`` or rank 0's reference, and its
    criteria said "not measured". A peer stuck in a collective never marks: the wait ends after
    ``REPORTS_WAIT_S``; rank 0 gone (it hosts the store) ends it at once.
    """
    if store is None:  # the script never wrapped a model in DDP
        return
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        store.set(f"shard_reports/{rank}", "1")
        if failed:
            others = [f"shard_reports/{r}" for r in range(world_size) if r != rank]
            store.wait(others, timedelta(seconds=REPORTS_WAIT_S))
    except Exception:  # noqa: BLE001 - timed out, or the store's host has exited: end as the script did
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
